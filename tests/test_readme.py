"""The README stays a short front door whose commands run: at most 200 lines; every `python scripts/...`
command in a code block of README.md or docs/*.md names a script and config files that exist, and each
`--config.a.b=value` is a key of the config that command builds (`get_config(arg)` of its config file,
as scripts/train.py's `--config file.py:arg` does); every relative link and image in them points at a
file of this repository (and a heading that exists, for `#anchors` into Markdown); the README's layout
table names every module of gspo_jax/, and its main job is described with its config's values.
Nothing is run or compiled: the configs are only built.

A command whose config path holds a shell variable (`configs/$a.py` in a for loop) has that path
skipped; its overrides are then checked against no config and are not checked.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import shlex
from pathlib import Path

import ml_collections
import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_README_LINES = 200

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def code_blocks(text: str) -> list[str]:
    """The contents of the fenced code blocks of a Markdown text."""
    return _FENCE.findall(text)


def commands(text: str) -> list[str]:
    """Every shell command in `text`'s code blocks that runs `python scripts/...` or `python -m
    benchmarks...`, continuation lines joined."""
    found = []
    for block in code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            if re.search(r"(^|\s)python3?\s+(scripts/|-m\s+benchmarks\b)", line):
                found.append(line.strip())
    return found


@functools.cache
def build_config(path: str, arg: str | None) -> ml_collections.ConfigDict:
    """What `--config path[:arg]` gives scripts/train.py: the file's `get_config(arg)` (no arg: its
    default), built without absl's flag machinery."""
    spec = importlib.util.spec_from_file_location(f"_readme_config_{Path(path).stem}", REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg is not None else module.get_config()


def missing_key(config: ml_collections.ConfigDict, dotted: str) -> str | None:
    """Why `dotted` is not a key of `config` (the first part that is absent), or None."""
    node = config
    for i, part in enumerate(dotted.split(".")):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            return f"config.{'.'.join(dotted.split('.')[: i + 1])} does not exist"
        node = node[part]
    return None


def problems(command: str) -> list[str]:
    """What is wrong with one `python scripts/...` command: a missing script or config file, or an
    override naming a key its config lacks. Empty when it would start."""
    tokens = shlex.split(command, comments=True)
    found, config = [], None
    scripts = [t for t in tokens if t.startswith("scripts/")]
    for module in (t.replace(".", "/") for t, m in zip(tokens[1:], tokens) if m == "-m"):
        package = f"{module}/__main__.py"  # `python -m pkg` runs the package's __main__
        scripts.append(package if (REPO / package).is_file() else f"{module}.py")
    if not scripts:
        return [f"no scripts/... in {command!r}"]
    if not (REPO / scripts[0]).is_file():
        found.append(f"{scripts[0]} does not exist")
    for i, token in enumerate(tokens):
        value = None
        if token == "--config" and i + 1 < len(tokens):
            value = tokens[i + 1]
        elif token.startswith("--config="):
            value = token.split("=", 1)[1]
        elif token.startswith("configs/") and tokens[i - 1] != "--config":
            value = token  # a positional config file, e.g. a sweep file
        if value is None or "$" in value:
            continue
        path, _, arg = value.partition(":")
        if not (REPO / path).is_file():
            found.append(f"{path} does not exist")
        elif token == "--config" or token.startswith("--config="):
            config = build_config(path, arg or None)
    for token in tokens:
        if token.startswith("--config."):
            key = token[len("--config.") :].split("=", 1)[0]
            if config is None:
                if not any("$" in t for t in tokens):
                    found.append(f"--config.{key} without a --config file")
            elif (why := missing_key(config, key)) is not None:
                found.append(why)
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def link_problems(md: Path, text: str | None = None) -> list[str]:
    """Every relative link or image of `md` (its `text`, default its contents) that points at no file
    of the repository (or, with `#anchor`, at no heading of that Markdown file)."""
    found = []
    for target in _LINK.findall(md.read_text(encoding="utf-8") if text is None else text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if REPO not in dest.parents and dest != REPO:
            found.append(f"{md.name}: {target} points outside the repository")
        elif not dest.exists():
            found.append(f"{md.name}: {target} does not exist")
        elif anchor and dest.suffix == ".md":
            anchors = {slug(h) for h in _HEADING.findall(dest.read_text(encoding="utf-8"))}
            if anchor not in anchors:
                found.append(f"{md.name}: {target}: no heading #{anchor} in {dest.name}")
    return found


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; at most {MAX_README_LINES}"


def test_readme_has_the_main_commands():
    text = README.read_text(encoding="utf-8")
    for line in ('pip install -e ".[dev,tpu]"', "python scripts/train.py --config configs/gspo.py --workdir", "pytest"):
        assert any(line in block for block in code_blocks(text)), f"README.md lost {line!r}"


@pytest.mark.parametrize("md", [README, *DOCS], ids=lambda p: p.name)
def test_commands_name_existing_scripts_configs_and_keys(md):
    cmds = commands(md.read_text(encoding="utf-8"))
    if md == README:
        assert len(cmds) >= 5, "the README's commands were not found"
    bad = {cmd: p for cmd in cmds if (p := problems(cmd))}
    assert not bad, "\n".join(f"{cmd}\n    {'; '.join(p)}" for cmd, p in bad.items())


@pytest.mark.parametrize("md", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_point_at_files(md):
    assert not (bad := link_problems(md)), "\n".join(bad)


def sci(x: float) -> str:
    """A number as the README writes a learning rate: 3e-4."""
    mantissa, exponent = f"{x:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def test_main_job_description_matches_its_config():
    """The README's account of the main job (iterations, batch, learning rate, evaluation, warm start)
    is that of `configs/gspo.py`'s default size, whatever the default becomes."""
    c = build_config("configs/gspo.py", None)
    text = " ".join(README.read_text(encoding="utf-8").split("\n## The main job", 1)[1].split("\n## ", 1)[0].split())
    expected = [
        f"{c.warm_start.steps} supervised steps",
        f"{c.train.num_iterations} {c.algorithm.upper()} iterations of {c.rollout.num_groups} prompts × "
        f"{c.rollout.group_size} samples at learning rate {sci(c.train.learning_rate)}",
        f"held-out accuracy every {c.train.eval_every} iterations",
    ]
    assert not (stale := [e for e in expected if e not in text]), f"README's main job should say: {stale}"


def test_layout_names_every_module():
    text = README.read_text(encoding="utf-8")
    layout = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    modules = [p.stem for p in (REPO / "gspo_jax").glob("*.py") if p.stem != "__init__"]
    missing = [m for m in sorted(modules) if f"`{m}`" not in layout and f"`{m}," not in layout]
    assert "`tasks/`" in layout, "the layout table lost gspo_jax/tasks/"
    assert "`study/`" in layout, "the layout table lost gspo_jax/study/"
    assert not missing, f"README's layout table misses gspo_jax/{', '.join(missing)}"


def test_the_checker_catches_what_it_should():
    """The checks above fail on a missing script, config file or key, and on a bad link."""
    assert problems("python scripts/no_such.py --config configs/gspo.py") == ["scripts/no_such.py does not exist"]
    assert problems("python scripts/train.py --config configs/no_such.py:tiny") == ["configs/no_such.py does not exist"]
    assert problems("python scripts/train.py --config configs/gspo.py:tiny --config.train.no_such=1") == [
        "config.train.no_such does not exist"
    ]
    assert problems("python scripts/train.py --config configs/gspo.py --config.task.gsm8k.nope=x") == [
        "config.task.gsm8k.nope does not exist"
    ]
    assert problems("python scripts/train.py --config configs/gspo.py --config.seed.x=1") == [
        "config.seed.x does not exist"
    ]
    assert problems("python scripts/sweep.py configs/sweeps/no_such.py --list") == [
        "configs/sweeps/no_such.py does not exist"
    ]
    assert problems("python -m benchmarks.no_such --only train") == ["benchmarks/no_such.py does not exist"]
    ok = "python scripts/train.py --config configs/ppo.py:tiny --workdir /tmp/x --config.critic.model.num_layers=2"
    assert problems(ok) == []
    assert commands("```bash\npython scripts/train.py \\\n    --config configs/gspo.py  # x\n```\n") == [
        "python scripts/train.py      --config configs/gspo.py  # x"
    ]
    bad_links = "[a](docs/NO_SUCH.md) [b](docs/USAGE.md#no-such-heading) ![c](../outside.png) [d](https://x.org)"
    assert link_problems(README, bad_links) == [
        "README.md: docs/NO_SUCH.md does not exist",
        "README.md: docs/USAGE.md#no-such-heading: no heading #no-such-heading in USAGE.md",
        "README.md: ../outside.png points outside the repository",
    ]
    assert sci(3e-4) == "3e-4" and sci(1.5e-6) == "1.5e-6"
    assert slug("Scale: will it fit on the pod?") == "scale-will-it-fit-on-the-pod"
    assert slug("Sampler–trainer mismatch and its corrections") == "samplertrainer-mismatch-and-its-corrections"
