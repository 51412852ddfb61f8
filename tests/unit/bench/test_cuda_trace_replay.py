"""bench/cuda_trace.py: a recorded CUDA allocation history is replayed through the allocator model the
way the real allocator served it (requests, completed frees, cache releases, the memory cap), and the
real reserved peak is read back from the history's own segment events. Synthetic histories in torch's
event vocabulary; the recorded GPU ones are replayed by bench/allocator_trace_check.py."""

from __future__ import annotations

import gzip
import json

from bench import allocator_trace_check, cuda_trace

MiB = 2**20


def _record(events, conf="", cap=None, max_reserved=0, max_allocated=0):
    actions = cuda_trace.ACTIONS
    return {"summary": {"alloc_conf": conf, "cap_bytes": cap, "max_reserved": max_reserved,
                        "max_allocated": max_allocated, "alloc_retries": 0},
            "actions": list(actions),
            "events": [[actions.index(a), addr, size, stream] for a, addr, size, stream in events]}


def test_the_real_reserved_peak_sums_segment_allocs_and_maps_minus_frees_and_unmaps():
    record = _record([("segment_alloc", 0, 20 * MiB, 0), ("alloc", 0, 3 * MiB, 0),
                      ("segment_map", 1 << 40, 40 * MiB, 0), ("segment_free", 0, 20 * MiB, 0),
                      ("segment_unmap", 1 << 40, 20 * MiB, 0), ("segment_alloc", 5, 2 * MiB, 0)])
    assert cuda_trace.real_reserved_peak(record) == 60 * MiB


def test_a_replay_follows_completed_frees_not_requested_ones():
    # A block whose free waits for another stream (record_stream) is not reusable until free_completed.
    events = [("alloc", 100, 3 * MiB, 0), ("free_requested", 100, 3 * MiB, 0),
              ("alloc", 200, 15 * MiB, 0), ("free_completed", 100, 3 * MiB, 0), ("alloc", 300, 3 * MiB, 0)]
    row = cuda_trace.replay_trace(_record(events))
    # 3 MiB and 15 MiB pack into one 20 MiB segment; the third reuses the first's completed block.
    assert row["model_reserved"] == 20 * MiB
    assert row["model_allocated"] == 18 * MiB
    assert row["unknown_frees"] == 0 and row["model_oom"] is None


def test_a_cache_release_in_the_history_empties_the_models_cache_there():
    events = [("segment_alloc", 0, 20 * MiB, 0), ("alloc", 0, 12 * MiB, 0), ("free_completed", 0, 12 * MiB, 0),
              ("segment_free", 0, 20 * MiB, 0), ("alloc", 1, 40 * MiB, 0)]
    row = cuda_trace.replay_trace(_record(events))
    assert row["cache_releases"] == 1
    assert row["model_reserved"] == 40 * MiB  # without the release: 20 + 40


def test_the_cap_and_the_recorded_settings_are_the_models():
    events = [("alloc", 1, 30 * MiB, 0), ("alloc", 2, 30 * MiB, 0)]
    capped = cuda_trace.replay_trace(_record(events, cap=50 * MiB))
    assert capped["model_oom"] is not None
    expandable = cuda_trace.replay_trace(_record([("alloc", 1, 3 * MiB, 0)], conf="expandable_segments:True"))
    assert expandable["model_reserved"] == 20 * MiB and expandable["settings"] == "expandable_segments:True"


def test_frees_of_blocks_allocated_before_the_history_started_are_counted_not_replayed():
    row = cuda_trace.replay_trace(_record([("free_completed", 7, MiB, 0), ("alloc", 1, MiB, 0)]))
    assert row["unknown_frees"] == 1 and row["model_allocated"] == MiB


def test_the_check_reads_history_files_and_prints_one_row_each(tmp_path, capsys, monkeypatch):
    record = _record([("segment_alloc", 0, 2 * MiB, 0), ("alloc", 0, 4096, 0)], max_reserved=2 * MiB,
                     max_allocated=4096)
    record["summary"].update(outside_allocator=500 * MiB, device_name="a GPU", torch="2", cuda="13")
    path = tmp_path / "one.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(record, f)
    monkeypatch.setattr("sys.argv", ["allocator_trace_check.py", str(tmp_path), "--json", str(tmp_path / "out.json")])
    assert allocator_trace_check.main() == 0
    rows = json.loads((tmp_path / "out.json").read_text())
    assert rows[0]["model_reserved"] == rows[0]["real_reserved"] == 2 * MiB
    assert "one.json.gz" in capsys.readouterr().out


def test_step_markers_split_the_peaks_into_set_up_steps_and_after():
    mark = cuda_trace.STEP_MARK_BYTES
    events = [("alloc", 1, 30 * MiB, 0), ("free_completed", 1, 30 * MiB, 0),  # set-up: 30 MiB
              ("alloc", 2, mark, 0), ("free_completed", 2, mark, 0),  # step 1 starts
              ("alloc", 3, 12 * MiB, 0), ("free_completed", 3, 12 * MiB, 0),
              ("alloc", 4, mark, 0), ("free_completed", 4, mark, 0),  # step 1 ends
              ("alloc", 5, mark, 0), ("free_completed", 5, mark, 0),  # step 2 starts
              ("alloc", 6, 14 * MiB, 0),
              ("alloc", 7, mark, 0), ("free_completed", 7, mark, 0),  # step 2 ends
              ("alloc", 8, 2 * MiB, 0)]  # the final save
    row = cuda_trace.replay_trace(_record(events))
    assert row["steps_marked"] == 2
    peaks = row["phase_peaks"]
    assert peaks["setup"]["allocated"] == 30 * MiB
    assert peaks["steps"]["allocated"] == 14 * MiB  # step 2's block (its markers' 4.5 KiB come and go)
    assert peaks["after"]["allocated"] == 16 * MiB  # step 2's block lives on into the save
    # The steps reuse set-up's cached 30 MiB segment; the markers take one 2 MiB small-pool segment.
    assert (peaks["setup"]["reserved"], peaks["steps"]["reserved"]) == (30 * MiB, 32 * MiB)
    assert cuda_trace.replay_trace(_record(events[:2]))["phase_peaks"] is None  # no markers, no phases


def test_the_need_is_the_least_cap_the_history_runs_in():
    # Two 30 MiB blocks, the first freed before the second: cached, the first segment would be reused,
    # so 30 MiB suffice although a roomy device reserved 30 (the history's own peak is its allocated one).
    events = [("alloc", 1, 30 * MiB, 0), ("free_completed", 1, 30 * MiB, 0), ("alloc", 2, 30 * MiB, 0),
              ("alloc", 3, 12 * MiB, 0)]
    record = _record(events, max_reserved=72 * MiB, max_allocated=42 * MiB)
    assert cuda_trace.needed_bytes(record) == 30 * MiB + 12 * MiB
    # an unsplittable layout needs more than its allocated bytes: 3 MiB requests pack into 20 MiB segments
    small = _record([("alloc", 1, 3 * MiB, 0)], max_reserved=20 * MiB, max_allocated=3 * MiB)
    assert cuda_trace.needed_bytes(small) == 20 * MiB
