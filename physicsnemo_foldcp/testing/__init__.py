"""Test harness: the ``multigpu_static`` pytest plugin, collective asserts, suite runner."""

from physicsnemo_foldcp.testing.asserts import (
    CollectiveAssertionError,
    collective_assert,
    collective_assert_close,
    collective_assert_equal,
)

__all__ = [
    "CollectiveAssertionError",
    "collective_assert",
    "collective_assert_close",
    "collective_assert_equal",
]
