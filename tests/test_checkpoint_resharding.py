"""Issue 7, acceptance 1 and 2 (fp32 part): a sharded checkpoint resumes on another world size
and stage with the uninterrupted trajectory; a save killed part-way leaves the previous
checkpoint loadable and the partial one recognisably incomplete."""

from __future__ import annotations

import pytest

from _scripts import max_rel_diff, run_json, run_script_failing

TOL = 1e-5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    out = run_json("reshard.py", tmp / "save.json", "--phase", "save", "--stage", "3", "--devices", "2",
                   "--ckpt-dir", str(tmp / "ck"))
    return tmp, out


@pytest.mark.parametrize("stage,devices", [(2, 1), (2, 3), (0, 2)])
def test_resume_on_other_world_size_and_stage(saved, stage, devices):
    tmp, save = saved
    ckpt = next(c for c in save["ckpts"] if "epoch=0" in c)
    resumed = run_json("reshard.py", tmp / f"r{stage}{devices}.json", "--phase", "resume", "--stage", str(stage),
                       "--devices", str(devices), "--ckpt", ckpt)
    assert len(resumed["losses"]) == 4
    assert max_rel_diff(resumed["losses"], save["losses"][4:]) < TOL


def test_resume_from_one_rank_stage2_on_two_ranks_stage3(tmp_path):
    save = run_json("reshard.py", tmp_path / "save.json", "--phase", "save", "--stage", "2", "--devices", "1",
                    "--ckpt-dir", str(tmp_path / "ck"))
    ckpt = next(c for c in save["ckpts"] if "epoch=0" in c)
    resumed = run_json("reshard.py", tmp_path / "r.json", "--phase", "resume", "--stage", "3", "--devices", "2",
                       "--ckpt", ckpt)
    assert max_rel_diff(resumed["losses"], save["losses"][4:]) < TOL


def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path):
    ck = tmp_path / "ck"
    run_script_failing("reshard.py", "--phase", "save", "--stage", "3", "--devices", "2", "--ckpt-dir", str(ck),
                       "--kill-at-save", "2", "--out", str(tmp_path / "never.json"), timeout=600,
                       why="the run was supposed to be killed during its second save")
    names = sorted(p.name for p in ck.iterdir())
    # the first checkpoint is complete, the second exists only as an incomplete staging dir
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt.incomplete"], names
    assert not (tmp_path / "never.json").exists()

    resumed = run_json("reshard.py", tmp_path / "r.json", "--phase", "resume", "--stage", "3", "--devices", "2",
                       "--ckpt", str(ck / "epoch=0-step=4.ckpt"))
    assert len(resumed["losses"]) == 4

    with pytest.raises(AssertionError, match="interrupted save"):
        run_json("reshard.py", tmp_path / "bad.json", "--phase", "resume", "--stage", "3", "--devices", "2",
                 "--ckpt", str(ck / "epoch=1-step=8.ckpt.incomplete"))
    with pytest.raises(AssertionError, match="save was interrupted"):
        run_json("reshard.py", tmp_path / "bad.json", "--phase", "resume", "--stage", "3", "--devices", "2",
                 "--ckpt", str(ck / "epoch=1-step=8.ckpt"))
