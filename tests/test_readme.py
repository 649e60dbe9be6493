"""Every shell command in README.md (its ```bash blocks) runs as written and succeeds.

The commands run in README order, one shell each, in a scratch directory laid out like a checkout (links to this
repository's Makefile, pyproject.toml, .venv, src, configs, docs and examples), so what they write (runs/, profile.json,
timeline.png) lands there and later commands see what earlier ones left, as a reader's would. ``stratum`` is the
repository's .venv/bin/stratum. One command is not run: ``make test`` is this test suite itself (it would run
this test again, without end); ``.ci/run`` runs it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from doc_blocks import bash_commands

REPO = Path(__file__).resolve().parent.parent
LINKED = ("Makefile", "pyproject.toml", ".venv", "src", "configs", "docs", "examples")
NOT_RUN = {"make test": "the test suite itself"}


COMMANDS = bash_commands((REPO / "README.md").read_text())


def test_the_readme_has_commands_and_each_is_found():
    assert len(COMMANDS) >= 10 and "stratum train" in COMMANDS and "make train" in COMMANDS
    assert bash_commands("x\n```bash\na --b  # c\n# d\n\ne\n```\n```\nnot bash\n```\n") == ["a --b", "e"]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("readme")
    for name in LINKED:
        (root / name).symlink_to(REPO / name)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs_as_written(command, checkout):
    if command in NOT_RUN:
        pytest.skip(f"{command!r} is {NOT_RUN[command]}")
    env = dict(os.environ, PATH=f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    res = subprocess.run(["bash", "-c", command], cwd=checkout, env=env, capture_output=True, text=True,
                         timeout=280)
    assert res.returncode == 0, f"{command}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr and "stratum: error" not in res.stderr, res.stderr
