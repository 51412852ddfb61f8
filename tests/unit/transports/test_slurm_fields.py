"""What the #SBATCH lines may carry (issue 38, item 9): every user value is checked by the rule of
its kind (names, times, memory, paths, extra options, ports) and written as exactly one word of
the line as sbatch itself splits it (`sbatch_words`, a port of src/sbatch/opt.c's `_get_argument`)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrate.errors import UserError
from orchestrate.transports.slurm import cluster as slurm_cluster
from orchestrate.transports.slurm.job import SlurmJob, render_sbatch, sbatch_word
from tests.daemons import require_slurm, wait_job

PYTHON = "/opt/venv/bin/python"
_C_SPACE = " \t\n\v\f\r"


def sbatch_words(line: str) -> list[str]:
    """The words sbatch reads from one `#SBATCH ...` line: split at unquoted whitespace, '...' and
    "..." group, a backslash escapes the next character but whitespace (inside quotes too), an
    unquoted # ends the line."""
    words, i, rest = [], 0, line[len("#SBATCH"):]
    while True:
        while i < len(rest) and rest[i] in _C_SPACE:
            i += 1
        word, quote, escaped = None, "", False
        while i < len(rest) and (quote or rest[i] not in _C_SPACE):
            c = rest[i]
            i += 1
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
                continue
            elif quote:
                if c == quote:
                    quote = ""
                    continue
            elif c in "\"'":
                quote, word = c, word or ""
                continue
            elif c == "#":
                return words + ([word] if word is not None else [])
            word = (word or "") + c
        assert not quote, f"sbatch: unmatched {quote} in {line!r}"
        if word is None:
            return words
        words.append(word)


def header_words(script: str) -> list[list[str]]:
    """Each #SBATCH line's words, up to the first line sbatch takes for a command."""
    lines = []
    for line in script.split("\n")[1:]:
        if line.startswith("#SBATCH"):
            lines.append(sbatch_words(line))
        elif line.strip() and not line.lstrip().startswith("#"):
            return lines
    return lines


def _job(**kw) -> SlurmJob:
    return SlurmJob(**{"run_dir": Path("/runs/x"), "nodes": 2, "procs_per_node": 1, "python": PYTHON, **kw})


def test_the_sbatch_word_splitter_reads_lines_as_sbatch_does():
    # A backslash does not keep a space in the word: sbatch checks for whitespace first.
    assert sbatch_words('#SBATCH --a "b c" d\\ e \'f"g\' # --not-this') == ["--a", "b c", "d", "e", 'f"g']
    assert sbatch_words("#SBATCH --x=a#b") == ["--x=a"]
    assert sbatch_words('#SBATCH "--x=a\\"b\\\\c"') == ['--x=a"b\\c']


def test_names_with_an_option_inside_are_refused_each_by_its_flag():
    job = _job(partition="gpu --wrap=touch /x", account="proj 42", job_name="a\nb", time="4:00:00 --x",
               mem="64G --x", extra_sbatch=("--exclusive", "x", "--comment=a\nb", "--comment=a hetjob"),
               rdzv_port=99999)
    with pytest.raises(UserError) as e:
        render_sbatch(job)
    where = [p.where for p in e.value.problems]
    assert where == ["--job-name", "--partition", "--account", "--mem", "--time", "rdzv_port",
                     "--sbatch-option", "--sbatch-option", "--sbatch-option"]
    assert "99999 is not a TCP port (1 to 65535)" in str(e.value)


@pytest.mark.parametrize("run_dir", ["/runs/a\nb", "/runs/a\\b", "/runs/a\rb", "/runs/HetJob-1", "runs/rel"])
def test_paths_sbatch_cannot_read_back_are_refused(run_dir):
    with pytest.raises(UserError) as e:
        render_sbatch(_job(run_dir=Path(run_dir)))
    assert [p.where for p in e.value.problems] == ["run_dir"]


def test_paths_and_options_with_spaces_quotes_and_hashes_are_one_word_each(tmp_path):
    run_dir = Path("/shared/my runs/it's \"50%\" #2")
    script = render_sbatch(_job(run_dir=run_dir, partition="gpu,debug", extra_sbatch=("--comment=two words",)))
    words = header_words(script)
    assert all(len(w) == 1 for w in words), words
    flat = [w[0] for w in words]
    assert f"--chdir={run_dir}" in flat and "--partition=gpu,debug" in flat and "--comment=two words" in flat
    assert f"--output={str(run_dir).replace('%', '%%')}/slurm-%j.out" in flat
    # The shell reads the same paths as one word each, and the script is still valid bash.
    requeue = next(line for line in script.splitlines() if "REQUEUE" in line and line.startswith("if "))
    tokens = shlex.split(requeue)
    assert tokens[tokens.index("-f") + 1] == str(run_dir / "REQUEUE")
    assert str(run_dir / "plan.json") in shlex.split(script.split("srun ", 1)[1].split(" &\n")[0].replace("\\\n", ""))
    (tmp_path / "job.sbatch").write_text(script)
    subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], check=True)


def test_plain_values_stay_bare():
    assert sbatch_word("--partition=gpu") == "--partition=gpu"
    assert sbatch_word("--output=/runs/x/slurm-%j.out") == "--output=/runs/x/slurm-%j.out"
    assert sbatch_word("--comment=a b") == '"--comment=a b"'


_TEXT = st.one_of(
    st.from_regex(r"\A[a-z0-9][a-z0-9_.,-]{0,10}\Z"),
    st.text(st.one_of(st.sampled_from(list("az09-_.,+ \"'#%\\\n\t$;=")), st.characters()), max_size=14))


_VALID = {"partition": "gpu", "account": "proj42", "job_name": "run", "time": "4:00:00", "mem": "64G",
          "directory": "x", "extra": "note"}


def _expected_words(v: dict[str, str]) -> list[str]:
    run_dir = Path("/runs") / v["directory"]
    return [f"--job-name={v['job_name']}", f"--partition={v['partition']}", f"--account={v['account']}",
            f"--time={v['time']}", f"--mem={v['mem']}", f"--chdir={run_dir}",
            f"--output={str(run_dir).replace('%', '%%')}/slurm-%j.out", f"--comment={v['extra']}"]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(field=st.sampled_from(sorted(_VALID)), value=_TEXT)
def test_sbatch_fields_either_come_back_as_one_word_each_or_one_user_error(field, value):
    """Any value in any field: one UserError, or a script whose #SBATCH lines sbatch splits into
    exactly one word each, the intended ones among them (the partition one option value, the paths
    whole)."""
    v = {**_VALID, field: value}
    job = _job(partition=v["partition"], account=v["account"], job_name=v["job_name"], time=v["time"],
               mem=v["mem"], run_dir=Path("/runs") / v["directory"], extra_sbatch=("--comment=" + v["extra"],))
    try:
        script = render_sbatch(job)
    except UserError as e:
        assert e.problems
        return
    words = header_words(script)
    assert all(len(w) == 1 for w in words), words
    flat = [w[0] for w in words]
    assert set(_expected_words(v)) <= set(flat), (_expected_words(v), flat)
    assert len(flat) == script.count("\n#SBATCH ")


@pytest.mark.daemons
def test_real_sbatch_reads_the_quoted_words_back(monkeypatch, tmp_path):
    """The header as rendered, run by a real Slurm: the job starts in the run directory whose name
    has a space, quotes, # and %, writes its output there under its own job id, and keeps the
    extra option's value with its space as one word."""
    cluster = require_slurm(monkeypatch)
    run_dir = tmp_path / "my runs" / "it's \"50%\" #2"
    run_dir.mkdir(parents=True)
    job = _job(run_dir=run_dir, nodes=1, partition=cluster.partition, signal_lead_s=0, requeue=False,
               extra_sbatch=("--comment=two words",))
    header = [line for line in render_sbatch(job).splitlines() if line.startswith(("#!", "#SBATCH"))]
    script = run_dir / "job.sbatch"
    script.write_text("\n".join([*header, "pwd", 'scontrol show job -o "$SLURM_JOB_ID"', ""]))
    job_id = slurm_cluster.submit(script)
    assert wait_job(job_id, timeout=60)["JobState"] == "COMPLETED"
    output = (run_dir / f"slurm-{job_id}.out").read_text()
    assert output.splitlines()[0] == str(run_dir) and "Comment=two words" in output
