"""Every command shown in the README and in docs/ runs as shown.

The commands are the lines of the pages' ``bash`` blocks (``\\`` continuations joined,
comment lines and trailing comments dropped). Each one is checked without being run:

- the program is one the checker knows (python, torchrun, make, pip, ruff, ...);
- a script or module it names exists;
- a Hydra app's overrides compose against ``conf/`` (with the YAML files the pages write
  there, e.g. ``conf/model/mine.yaml``), pass the app's schema, and give a mesh that fits
  the number of processes the command starts;
- an argparse script's arguments parse with the script's own parser (the script is run in
  this process up to its ``parse_args`` call, which is stopped there);
- torchrun's and pytest's own flags parse, and a make target exists: ``make -n`` works and
  every command it prints passes the same checks.

The short ones are then run for real: the plan report, and ``show_mesh.py`` and
``scatter_sample.py`` on one process. A checker that cannot fail checks nothing, so the
last tests give it bad commands and expect it to name what is wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import io
import math
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tomllib
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
PYTHON = re.compile(r"python(3(\.\d+)?)?")
SEPARATORS = {"&&", "||", ";", "|"}
SHELL_BUILTINS = {"[", "test", "touch", "true", ":", "echo", "cd"}
MAKE_VARIABLES = {
    "MAKEFLAGS",
    "MFLAGS",
    "MAKELEVEL",
    "MAKEOVERRIDES",
    "MAKE_TERMOUT",
    "MAKE_TERMERR",
}
LAUNCHER_VARIABLES = {"WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}  # fmt: skip
# Run for real when shown on one process (each takes seconds, not minutes).
SHORT_MODULES = {"physicsnemo_foldcp.cli.plan_report"}
SHORT_SCRIPTS = {"examples/show_mesh.py", "examples/scatter_sample.py"}


@dataclasses.dataclass(frozen=True)
class Command:
    """One shell command of a page: where it is and its text as the shell reads it."""

    page: str
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def shell_commands(markdown: str, page: str = "<page>") -> list[Command]:
    """The commands of every ```bash block of ``markdown``, continuations joined."""
    commands = []
    in_block, pending, start = False, "", 0
    for number, line in enumerate(markdown.splitlines(), start=1):
        stripped = line.strip()
        if not in_block:
            in_block = stripped == "```bash"
            continue
        if stripped.startswith("```"):
            in_block = False
            continue
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        commands.append(Command(page, start, (pending + stripped).strip()))
        pending = ""
    return commands


def page_commands() -> list[Command]:
    return [c for p in PAGES for c in shell_commands(p.read_text(), str(p.relative_to(ROOT)))]


def config_files(markdown: str) -> dict[str, str]:
    """YAML blocks whose first line names a file under conf/: ``# conf/model/mine.yaml: ...``."""
    out = {}
    for block in re.findall(r"```yaml\n(.*?)```", markdown, flags=re.S):
        first = re.match(r"#\s*conf/(\S+?\.yaml)", block)
        if first:
            out[first.group(1)] = block
    return out


def words_of(text: str) -> list[list[str]]:
    """The simple commands of one shell line, split at ``&&``, ``||``, ``;`` and ``|``."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    parts: list[list[str]] = [[]]
    for token in lexer:
        if token in SEPARATORS:
            parts.append([])
        else:
            parts[-1].append(token)
    return [p for p in parts if p]


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


def first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


class Checker:
    """Checks shell commands against the repository; each check returns its problems."""

    def __init__(self, root: Path, conf_dir: Path, pytest_parser=None):
        self.root = root
        self.conf_dir = conf_dir
        self.pytest_parser = pytest_parser
        self.makefile = root / "Makefile"

    # -- entry points --------------------------------------------------------------------
    def check(self, text: str) -> list[str]:
        try:
            parts = words_of(text)
        except ValueError as err:
            return [f"does not parse as a shell command: {err}"]
        return [p for words in parts for p in self.check_words(words)]

    def check_words(self, words: Sequence[str], world: int = 1) -> list[str]:
        program, *args = words
        name = os.path.basename(program)
        if program == "export":
            bad = [a for a in args if not re.fullmatch(r"[A-Za-z_]\w*=.*", a)]
            return [f"export of {bad}: write NAME=VALUE"] if bad else []
        if program in (".", "source"):
            ok = len(args) == 1 and args[0].endswith("bin/activate")
            return [] if ok else [f"{program} {args}: only a venv's bin/activate is sourced"]
        if program in SHELL_BUILTINS:
            return []
        if program == "make":
            return self.check_make(args)
        if PYTHON.fullmatch(name):
            return self.check_python(args, world)
        if name == "torchrun":
            return self.check_torchrun(args)
        if name == "pip":
            return self.check_pip(args)
        if name == "ruff":
            return self.check_ruff(args)
        return [f"unknown program {program!r}: teach test/test_docs_commands.py to check it"]

    # -- python, torchrun ----------------------------------------------------------------
    def check_python(self, args: Sequence[str], world: int) -> list[str]:
        if not args:
            return ["python without a script or module"]
        if args[0] == "-m":
            if len(args) < 2:
                return ["python -m without a module"]
            return self.check_module(args[1], args[2:], world)
        if args[0].startswith("-"):
            return [f"python option {args[0]!r} is not checked; use a script or -m"]
        return self.check_script(args[0], args[1:], world)

    def check_torchrun(self, args: Sequence[str]) -> list[str]:
        from torch.distributed.run import get_args_parser

        ns, problem = self.parse(get_args_parser(), args, "torchrun")
        if problem:
            return [problem]
        try:
            nodes = int(str(ns.nnodes).split(":")[-1])
            world = nodes * int(ns.nproc_per_node)
        except ValueError:
            return [f"torchrun --nproc-per-node {ns.nproc_per_node}: give a number"]
        if ns.no_python:
            return ["torchrun --no-python is not checked"]
        if ns.module:
            return self.check_module(ns.training_script, ns.training_script_args, world)
        return self.check_script(ns.training_script, ns.training_script_args, world)

    def check_module(self, module: str, args: Sequence[str], world: int) -> list[str]:
        if module == "venv":
            return [] if len(args) == 1 else [f"python -m venv {list(args)}: give one directory"]
        if module == "pip":
            return self.check_pip(args)
        if module == "torch.distributed.run":
            return self.check_torchrun(args)
        if module == "pytest":
            return self.check_pytest(args)
        if module == "ruff":
            return self.check_ruff(args)
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            return [f"no module {module!r}"]

        def run() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # already imported: fine
                runpy.run_module(module, run_name="__main__", alter_sys=True)

        return self.check_argparse(run, [module, *args], world, f"-m {module}")

    def check_script(self, script: str, args: Sequence[str], world: int) -> list[str]:
        path = self.root / script
        if not path.is_file():
            return [f"names a missing file {script!r}"]
        source = path.read_text()
        if "@hydra.main" in source:
            return self.check_hydra(path, source, args, world)
        return self.check_argparse(
            lambda: runpy.run_path(str(path), run_name="__main__"),
            [str(path), *args],
            world,
            script,
        )

    # -- argparse scripts: parsed by their own parser -------------------------------------
    def parse(self, parser: argparse.ArgumentParser, args: Sequence[str], what: str):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                return parser.parse_args(list(args)), None
        except SystemExit:
            lines = err.getvalue().strip().splitlines() or ["argument error"]
            return None, f"{what}: {lines[-1]}"

    def check_argparse(
        self, run: Callable[[], object], argv: list[str], world: int, what: str
    ) -> list[str]:
        original = argparse.ArgumentParser.parse_args

        def stop_after_parsing(parser, args=None, namespace=None):
            raise _Parsed(original(parser, args, namespace))

        err = io.StringIO()
        saved_argv = sys.argv
        sys.argv = list(argv)
        argparse.ArgumentParser.parse_args = stop_after_parsing
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                run()
        except _Parsed as parsed:
            return self.check_parsed_mesh(parsed.namespace, world, what)
        except SystemExit as exit_:
            lines = err.getvalue().strip().splitlines() or [f"exit {exit_.code}"]
            return [f"{what}: {lines[-1]}"]
        except Exception as error:  # noqa: BLE001 - the problem is reported, with its type
            return [f"{what}: {type(error).__name__}: {first_line(error)}"]
        finally:
            argparse.ArgumentParser.parse_args = original
            sys.argv = saved_argv
        return [f"{what}: never parsed its arguments with argparse; cannot check it"]

    @staticmethod
    def check_parsed_mesh(ns: argparse.Namespace, world: int, what: str) -> list[str]:
        cp = getattr(ns, "cp", None)
        if not cp:
            return []
        ddp = getattr(ns, "ddp", -1)
        ranks = math.prod(cp) * (ddp if isinstance(ddp, int) and ddp > 0 else 1)
        fits = world == ranks if isinstance(ddp, int) and ddp > 0 else world % ranks == 0
        if fits or "plan_report" in what:  # the plan report needs no processes
            return []
        return [f"{what}: --cp {' '.join(map(str, cp))} needs {ranks} processes, got {world}"]

    # -- Hydra apps: composed against conf/ -----------------------------------------------
    def check_hydra(self, path: Path, source: str, overrides: Sequence[str], world: int):
        from hydra import compose, initialize_config_dir

        from physicsnemo_foldcp.distributed.bootstrap import resolve_mesh_shape
        from physicsnemo_foldcp.features import FeatureRegistry
        from physicsnemo_foldcp.training import config as schemas

        name = re.search(r"config_name=\"(\w+)\"", source)
        schema = re.search(r"typed\((\w+AppConfig), cfg", source)
        if not name or not schema:
            return [f"{path.name}: cannot find its config_name and schema"]
        what = f"{path.relative_to(self.root)}"
        try:
            with initialize_config_dir(config_dir=str(self.conf_dir), version_base=None):
                cfg = compose(config_name=name.group(1), overrides=list(overrides))
        except Exception as error:  # noqa: BLE001
            return [f"{what}: {first_line(error)}"]
        try:
            conf = schemas.typed(getattr(schemas, schema.group(1)), cfg, None)
            if hasattr(conf, "data"):
                schemas.data_config(conf.data)
            schemas.sharding_options(conf.sharding)
            FeatureRegistry.from_config(dataclasses.asdict(conf.registry))
        except Exception as error:  # noqa: BLE001
            return [f"{what}: {type(error).__name__}: {first_line(error)}"]
        try:
            resolve_mesh_shape(conf.mesh.ddp, tuple(conf.mesh.cp), world)
        except ValueError as error:
            return [f"{what} on {world} process(es): {first_line(error)}"]
        return []

    # -- make, pip, ruff, pytest ----------------------------------------------------------
    def make_targets(self) -> set[str]:
        if not self.makefile.is_file():
            return set()
        targets = set()
        for line in self.makefile.read_text().splitlines():
            match = re.match(r"^([A-Za-z0-9_.][\w. -]*?)\s*:(?![=:])", line)
            if match:
                targets |= set(match.group(1).split())
        return targets

    def make_defaults(self) -> set[str]:
        """Variables the Makefile gives a default (``NAME ?= value``)."""
        if not self.makefile.is_file():
            return set()
        text = self.makefile.read_text()
        return set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)\s*\?=", text, flags=re.MULTILINE))

    def check_make(self, args: Sequence[str]) -> list[str]:
        if any(a.startswith("-") for a in args):
            return [f"make {list(args)}: flags are not checked"]
        targets = [a for a in args if "=" not in a] or ["help"]
        missing = sorted(set(targets) - self.make_targets())
        if missing:
            return [f"make: no target {t!r} in the Makefile" for t in missing]
        if not shutil.which("make"):
            return []  # the targets exist; what they run is checked where make is installed
        # Not the variables of a make this test may run under (`make test ARGS=...` puts
        # ARGS in the environment, where the Makefile's `ARGS ?=` would take it).
        dropped = MAKE_VARIABLES | self.make_defaults()
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        done = subprocess.run(
            ["make", "-s", "-n", *args],
            cwd=self.root, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if done.returncode:
            return [f"make -n {' '.join(args)}: {(done.stderr or done.stdout).strip()}"]
        problems = []
        for line in done.stdout.splitlines():
            problems += [f"make {' '.join(args)} runs {line!r}: {p}" for p in self.check(line)]
        return problems

    def check_pip(self, args: Sequence[str]) -> list[str]:
        if not args or args[0] != "install":
            return [f"pip {list(args)}: only pip install is checked"]
        rest = list(args[1:])
        if rest in (["--upgrade", "pip"], ["-U", "pip"]):
            return []
        if len(rest) == 2 and rest[0] == "-e":
            match = re.fullmatch(r"([^\[]+)(?:\[([\w,-]+)\])?", rest[1])
            if not match or not (self.root / match.group(1) / "pyproject.toml").is_file():
                return [f"pip install -e {rest[1]!r}: no project there"]
            pyproject = tomllib.loads((self.root / match.group(1) / "pyproject.toml").read_text())
            known = set(pyproject["project"].get("optional-dependencies", {}))
            extras = set(filter(None, (match.group(2) or "").split(",")))
            return [
                f"pip install: no extra {e!r} in pyproject.toml" for e in sorted(extras - known)
            ]
        return [f"pip install {rest}: not checked"]

    def check_ruff(self, args: Sequence[str]) -> list[str]:
        if not args or args[0] != "check":
            return [f"ruff {list(args)}: only ruff check is checked"]
        return [f"ruff check: no path {a!r}" for a in args[1:] if not a.startswith("-")
                if not (self.root / a).exists()]  # fmt: skip

    def check_pytest(self, args: Sequence[str]) -> list[str]:
        if self.pytest_parser is None:
            return ["pytest: its argument parser is not at hand, so the flags cannot be checked"]
        try:
            ns, unknown = self.pytest_parser.parse_known_and_unknown_args(list(args))
        except Exception as error:  # noqa: BLE001
            return [f"pytest: {first_line(error)}"]
        problems = [f"pytest: unknown flag {u!r}" for u in unknown]
        for target in getattr(ns, "file_or_dir", None) or []:
            if not (self.root / target.split("::")[0]).exists():
                problems.append(f"pytest: no test path {target!r}")
        return problems


# -- fixtures ---------------------------------------------------------------------------
COMMANDS = page_commands()


@pytest.fixture(scope="module")
def checker(tmp_path_factory, pytestconfig):
    """A checker whose conf/ also holds the config files the pages tell the reader to write."""
    conf = tmp_path_factory.mktemp("docs") / "conf"
    shutil.copytree(ROOT / "conf", conf)
    for page in PAGES:
        for name, text in config_files(page.read_text()).items():
            (conf / name).parent.mkdir(parents=True, exist_ok=True)
            (conf / name).write_text(text)
    # pytest's own parser, with the project's plugin options (no public accessor).
    return Checker(ROOT, conf, getattr(pytestconfig, "_parser", None))


# -- the pages --------------------------------------------------------------------------
def test_the_pages_show_the_two_commands_and_many_more():
    texts = {c.text for c in COMMANDS}
    assert {"make train", "make test"} <= texts
    assert len(COMMANDS) >= 40, len(COMMANDS)
    readme = (ROOT / "README.md").read_text()
    assert readme.index("make train") < readme.index("## Install manually")
    assert len(readme.splitlines()) <= 200


def anchors(markdown: str) -> set[str]:
    """The heading anchors of a page, as GitHub makes them."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", markdown, flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_links_between_pages_are_relative_and_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)]+)\)", page.read_text()):
            assert not target.startswith(("/", "file:")), (page.name, target)
            if target.startswith(("http:", "https:")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path) if path else page
            assert linked.exists(), (page.name, target)
            if anchor:
                assert anchor in anchors(linked.read_text()), (page.name, target)


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_every_command_names_what_exists(checker, command):
    problems = checker.check(command.text)
    assert not problems, f"{command.where}: {command.text}\n" + "\n".join(problems)


def test_the_short_commands_run(tmp_path, monkeypatch):
    """The plan reports run in this process; show_mesh and scatter_sample as subprocesses."""
    from physicsnemo_foldcp.data.files import save_sample
    from physicsnemo_foldcp.data.synthetic import make_complex

    save_sample(make_complex(48, seed=0, msa_rows=4), tmp_path / "sample.pt")
    modules, scripts = [], []
    for command in COMMANDS:
        parts = words_of(command.text)
        words = parts[0] if len(parts) == 1 else []
        if len(words) < 2 or not PYTHON.fullmatch(os.path.basename(words[0])):
            continue
        if words[1] == "-m" and len(words) > 2 and words[2] in SHORT_MODULES:
            modules.append((command, words[2], words[3:]))
        elif words[1] in SHORT_SCRIPTS:
            scripts.append((command, words[1], words[2:]))
    assert {m for _, m, _ in modules} == SHORT_MODULES
    assert {s for _, s, _ in scripts} == SHORT_SCRIPTS

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(OMP_NUM_THREADS="1", FOLDCP_TIMEOUT_S="120")
    launched = [
        (c, subprocess.Popen(
            [sys.executable, str(ROOT / s), *a], cwd=tmp_path, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        ))
        for c, s, a in scripts
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    for command, module, args in modules:
        monkeypatch.setattr(sys, "argv", [module, *args])
        out = io.StringIO()
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with pytest.raises(SystemExit) as done:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        assert done.value.code in (0, None), f"{command.where}: {command.text}"
        assert "| rank |" in out.getvalue(), out.getvalue()[-2000:]
        png = [a for i, a in enumerate(args) if i and args[i - 1] == "--png"]
        assert all((tmp_path / p).is_file() for p in png), png
    for command, process in launched:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, f"{command.where}: {command.text}\n{output[-3000:]}"


def test_show_mesh_on_one_process_says_which_command_to_run(monkeypatch, capsys):
    """The one-process run of a 2x2 mesh stops with the torchrun command the docs show."""
    import physicsnemo_foldcp
    from physicsnemo_foldcp.distributed.bootstrap import resolve_mesh_shape

    def one_process(ddp=-1, cp=(1, 1), **_):
        resolve_mesh_shape(ddp, cp, 1)
        raise AssertionError("a 2x2 mesh fitted one process")

    monkeypatch.setattr(physicsnemo_foldcp, "init_mesh", one_process)
    monkeypatch.setattr(sys, "argv", ["show_mesh.py", "--cp", "2", "2"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(ROOT / "examples/show_mesh.py"), run_name="__main__")
    hint = "torchrun --standalone --nproc-per-node 4 examples/show_mesh.py --cp 2 2"
    assert "world size 1" in str(stopped.value.code) and hint in str(stopped.value.code)
    assert hint in {c.text for c in COMMANDS}


# -- the checker can fail ---------------------------------------------------------------
def test_the_extractor_joins_continuations_and_drops_comments():
    page = (
        "text\n```bash\n# a comment\ntorchrun --standalone --nproc-per-node 4 \\\n"
        "    examples/train.py mesh.cp=[2,2]  # trailing\n\npython -V\n```\n"
        "```python\nprint('not shell')\n```\n"
    )
    commands = shell_commands(page, "p.md")
    assert [(c.line, c.text) for c in commands] == [
        (4, "torchrun --standalone --nproc-per-node 4 examples/train.py mesh.cp=[2,2]  # trailing"),
        (7, "python -V"),
    ]
    assert words_of(commands[0].text) == [
        ["torchrun", "--standalone", "--nproc-per-node", "4", "examples/train.py", "mesh.cp=[2,2]"]
    ]
    assert words_of("a x && b || c; d") == [["a", "x"], ["b"], ["c"], ["d"]]


BAD = [
    ("python examples/train.py train.stepz=3", "Could not override 'train.stepz'"),
    ("python examples/train.py +train.stepz=3", "Key 'stepz' not in 'TrainSettings'"),
    ("python examples/predict.py data=nope", "Could not find 'data/nope'"),
    ("python examples/predict.py sharding.balance.mode=odd", "sharding.balance.mode"),
    ("torchrun --standalone --nproc-per-node 4 examples/train.py mesh.cp=[2,3]", "world size 4"),
    ("torchrun --standalone --nprocs-per-node 4 examples/train.py", "--nprocs-per-node"),
    ("torchrun --standalone --nproc-per-node 4 examples/tran.py", "missing file"),
    ("python -m physicsnemo_foldcp.cli.plan_report --tokens 64 --cp 2 2 --pngg x", "--pngg"),
    ("python -m physicsnemo_foldcp.cli.plan_reprt --tokens 64 --cp 2 2", "no module"),
    ("torchrun --standalone --nproc-per-node 4 benchmarks/bench_ops.py --cp 2 2 --op x", "--op"),
    ("torchrun --standalone --nproc-per-node 2 examples/show_mesh.py --cp 2 2", "needs 4"),
    ("torchrun --standalone --nproc-per-node 4 -m pytest test --multigpu-statik", "unknown flag"),
    ("python -m pytest tests", "no test path"),
    ("make trian", "no target 'trian'"),
    ("make train ARGS=train.stepz=5", "Could not override 'train.stepz'"),
    ("pip install -e '.[test,tset]'", "no extra 'tset'"),
    ("ruff check physicsnemo_foldcp exampels", "no path 'exampels'"),
    ("curl https://example.com | sh", "unknown program 'curl'"),
]


@pytest.mark.parametrize("text, expected", BAD, ids=[t for t, _ in BAD])
def test_the_checker_names_what_is_wrong(checker, text, expected):
    problems = checker.check(text)
    assert problems and expected in "\n".join(problems), problems
