"""The package without PyTorch Lightning: it imports, the data module is a plain class,
``physicsnemo_foldcp.lightning`` names what to install, and the data tests pass.

Lightning is hidden from a fresh interpreter (``sys.modules["pytorch_lightning"] = None``
makes every import of it fail), which then runs the data module's and the options' tests.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

WITHOUT_LIGHTNING = """
import sys
sys.modules["pytorch_lightning"] = None
import physicsnemo_foldcp as fc
assert fc.FoldCPDataModule.__mro__[1:] == (object,), fc.FoldCPDataModule.__mro__
try:
    import physicsnemo_foldcp.lightning
except ImportError as err:
    assert "pip install" in str(err), err
else:
    raise AssertionError("physicsnemo_foldcp.lightning imported without Lightning")
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


def test_the_data_module_is_lightnings_when_lightning_is_installed():
    pl = pytest.importorskip("pytorch_lightning")
    from physicsnemo_foldcp import FoldCPDataModule

    assert issubclass(FoldCPDataModule, pl.LightningDataModule)


def test_without_lightning_the_package_imports_and_the_data_tests_pass():
    tests = ["test/data/test_datamodule.py", "test/test_options.py"]
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_LIGHTNING, *tests],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-2000:]
