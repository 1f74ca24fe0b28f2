"""A reference model that fails once at a given forward call (for the rerun and restart tests).

``FOLDCP_TEST_CRASH_AT``: the forward call (1-based) that raises; ``FOLDCP_TEST_CRASH_MARKER``:
a path prefix; each rank creates ``<prefix>.<rank>`` when it fails, and does not fail again.
"""

import os
from pathlib import Path

from physicsnemo_foldcp.models import ReferenceFoldModel


class CrashOnce(ReferenceFoldModel):
    """:class:`ReferenceFoldModel` whose forward raises once, at call ``FOLDCP_TEST_CRASH_AT``."""

    def __init__(self, **sizes: int):
        super().__init__(**sizes)
        self.calls = 0

    def forward(self, **features):
        """The reference forward, after counting the call (and failing once)."""
        self.calls += 1
        marker = Path(f"{os.environ['FOLDCP_TEST_CRASH_MARKER']}.{os.environ.get('RANK', '0')}")
        if self.calls == int(os.environ["FOLDCP_TEST_CRASH_AT"]) and not marker.exists():
            marker.touch()
            raise RuntimeError(f"injected failure at step {self.calls}")
        return super().forward(**features)
