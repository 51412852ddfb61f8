"""What the #SBATCH lines may carry (issue 38, item 9): every user value is checked by the rule of
its kind (names, times, memory, paths, extra options, ports) and written as exactly one word of
the line as sbatch itself splits it (`sbatch_words`, a port of src/sbatch/opt.c's `_get_argument`)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings

from orchestrate.errors import UserError
from orchestrate.transports.slurm import cluster as slurm_cluster
from orchestrate.transports.slurm.job import render_sbatch, sbatch_word
from tests.daemons import require_slurm, wait_job
from tests.helpers.input_fuzz import check_slurm_field, header_words, sbatch_words, slurm_fields
from tests.helpers.input_fuzz import slurm_job as _job


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


@settings(max_examples=300, deadline=None, derandomize=True)
@given(slurm_fields)
def test_sbatch_fields_either_come_back_as_one_word_each_or_one_user_error(field_value):
    """Any value in any field: one UserError, or a script whose #SBATCH lines sbatch splits into
    exactly one word each, the intended ones among them (the partition one option value, the paths
    whole)."""
    check_slurm_field(field_value)


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
