"""The cost model (cost.py): interpolation between calibrated points, the checks on a
calibration's numbers, a calibration of a small model, and its file: written once per
key, read back, and measured anew (never trusted) when it is broken or another key's."""

import json
import logging
import math
import os

import jax
import jax.numpy as jnp
import pytest

from packed_ss_jax import cost
from tiny import tiny_model

MODEL = tiny_model(0)
SMALL = dict(rows=(1, 4), positions=(16, 32), repeat=2)   # a quick calibration


def _synthetic(key="k"):
    # 1 ms + 0.1 ms per row at 16 positions, twice that at 32
    return cost.CostModel(key, (1, 8), (16, 32), ((1.1e-3, 1.8e-3), (2.2e-3, 3.6e-3)))


def test_calls_between_and_past_the_points_are_interpolated():
    c = _synthetic()
    assert c.call_s(1, 16) == pytest.approx(1.1e-3) and c.call_s(8, 32) == pytest.approx(3.6e-3)
    assert c.call_s(4.5, 16) == pytest.approx(1.45e-3)                  # between rows
    assert c.call_s(8, 24) == pytest.approx(2.7e-3)                     # between sizes
    assert c.call_s(15, 16) == pytest.approx(2.5e-3)                    # past the rows
    assert c.call_s(1, 1) == pytest.approx(1.1e-3)   # never below the cheapest call measured
    one = cost.CostModel("k", (4,), (64,), ((2e-3,),))
    assert one.call_s(1, 8) == one.call_s(100, 1000) == 2e-3
    assert cost.predicted_tokens_per_s(c, 3.0, 8, 16) == pytest.approx(3.0 / 1.8e-3)


def test_a_file_naming_the_positions_slots_is_read_as_it_is():
    """Calibrations written before the KV positions had their own name called them
    "slots": read as they are, not measured again."""
    data = _synthetic().to_json()
    assert data.pop("positions") == (16, 32)
    assert cost.CostModel.from_json({**data, "slots": [16, 32]}) == _synthetic()


def test_past_the_points_a_prediction_stays_near_what_was_measured():
    # Noise made the last segment fall, or climb steeply: past the grid a call costs at
    # least the last point's and at most that in proportion to its rows.
    falling = cost.CostModel("k", (1, 8, 16), (64,), ((1e-3, 4e-3, 3e-3),))
    assert falling.call_s(64, 64) == pytest.approx(3e-3)
    steep = cost.CostModel("k", (1, 8, 16), (64,), ((1e-3, 1e-3, 9e-3),))
    assert steep.call_s(32, 64) == pytest.approx(18e-3)   # the line would say 25 ms
    assert steep.call_s(12, 64) == pytest.approx(5e-3)    # inside the grid, the line


def test_an_unstable_calibration_says_so_and_records_the_load(monkeypatch, caplog):
    runs = iter([[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.5, 2.0, 1.0, 3.0],
                 [1.0, 1.4, 2.0, 1.0, 1.0, 1.0, 3.0, 1.8, 1.0, 1.0]])
    monkeypatch.setattr(cost, "time_call", lambda *a, **k: next(runs))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        c = cost.calibrate(MODEL, rows=(1, 4), positions=(16,))
    # The second point's runs spread (2.0 - 1.0) / 1.5 (the fastest and the slowest
    # left out); measured again, longer, still (2.0 - 1.0) / 1.0.
    assert c.seconds == ((1.0, 1.0),) and c.spread == pytest.approx(1.0) and c.unstable
    assert c.load is None or c.load >= 0
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "unstable" in warning and "4 rows over 16 positions spread 100%" in warning
    assert cost.CostModel.from_json(json.loads(json.dumps(c.to_json()))) == c


@pytest.mark.parametrize("seconds", [((1e-3, math.nan), (1e-3, 1e-3)),
                                     ((1e-3, -1.0), (1e-3, 1e-3)), ((1e-3,), (1e-3, 1e-3))])
def test_a_calibration_with_bad_numbers_is_refused(seconds):
    with pytest.raises(ValueError, match="positive number per"):
        cost.CostModel("k", (1, 8), (16, 32), seconds)
    with pytest.raises(ValueError, match="increasing"):
        cost.CostModel("k", (8, 1), (16, 32), ((1.0, 1.0), (1.0, 1.0)))


def test_a_small_model_is_calibrated():
    c = cost.calibrate(MODEL, **SMALL)
    assert (c.rows, c.positions) == ((1, 4), (16, 32))
    assert c.calibration_id == cost.calibration_id(MODEL)
    assert all(0 < s < 1 for r in c.seconds for s in r) and c.calibration_s > 0
    # Row counts that do not fit the smallest cache are left out.
    assert cost.calibrate(MODEL, rows=(1, 16), positions=(16,), repeat=1).rows == (1,)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), MODEL)
    assert cost.calibration_id(bf16) != c.calibration_id


def test_the_calibration_is_kept_and_read_back(tmp_path, monkeypatch):
    first = cost.load_or_calibrate(MODEL, tmp_path, **SMALL)
    path = tmp_path / f"{first.calibration_id}.json"
    assert path.is_file() and list(tmp_path.iterdir()) == [path]   # no temporary left

    def no_measuring(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(cost, "calibrate", no_measuring)
    assert cost.load_or_calibrate(MODEL, tmp_path) == first
    monkeypatch.setenv(cost.ENV, str(tmp_path))
    assert cost.load_or_calibrate(MODEL) == first


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 1}), "[]",
                                     "other-key"])
def test_a_broken_or_foreign_file_is_measured_anew(tmp_path, caplog, content):
    path = tmp_path / f"{cost.calibration_id(MODEL)}.json"
    if content == "other-key":
        content = json.dumps(_synthetic("another").to_json())
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="packed_ss_jax.cost"):
        c = cost.load_or_calibrate(MODEL, tmp_path, **SMALL)
    assert c.calibration_id == cost.calibration_id(MODEL) and str(path) in caplog.text
    assert cost.CostModel.from_json(json.loads(path.read_text())) == c


def test_a_directory_that_cannot_be_written_keeps_the_measurement(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING):
        c = cost.load_or_calibrate(MODEL, blocked / "cost", **SMALL)
    assert c.calibration_id == cost.calibration_id(MODEL)
    assert "not using the calibration folder" in caplog.text
    assert "measuring without keeping" in caplog.text


def test_without_a_directory_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(cost.ENV, raising=False)
    cost.load_or_calibrate(MODEL, None, **SMALL)
    assert list(tmp_path.iterdir()) == []
    assert cost.default_dir() == tmp_path / "packed_ss_jax" / "cost"


@pytest.mark.parametrize("text", ['{"version": 1, "key": "k", "rows": [1], "slots": [16], '
                                  '"seconds": [[1' + "0" * 400 + ']]}',
                                  "[" * 100000 + "]" * 100000])
def test_a_hostile_cost_file_is_measured_anew(tmp_path, text):
    first = cost.load_or_calibrate(MODEL, tmp_path, **SMALL)
    path = tmp_path / f"{first.calibration_id}.json"
    path.write_text(text)
    again = cost.load_or_calibrate(MODEL, tmp_path, **SMALL)
    assert again.calibration_id == first.calibration_id
    assert json.loads(path.read_text())["key"] == first.calibration_id   # the file's name for it


def _sparse(path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def _another_user(monkeypatch) -> None:
    # Files and folders made here become another user's: this process takes another user
    # id (giving a file away needs root, and a test must not).
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)


@pytest.mark.parametrize("damage", ["oversized", "world-writable", "foreign-owned", "fifo"])
def test_an_oversized_or_foreign_calibration_file_is_one_warning_and_measured_anew(
        tmp_path, caplog, monkeypatch, damage):
    first = cost.load_or_calibrate(MODEL, tmp_path, **SMALL)
    path = tmp_path / f"{first.calibration_id}.json"
    if damage == "oversized":   # 16 GB, sparse: read whole it would not fit in memory
        path.unlink()
        _sparse(path, 16 << 30)
    elif damage == "world-writable":
        path.chmod(0o666)
    elif damage == "fifo":
        path.unlink()
        os.mkfifo(path)
    measured = []
    monkeypatch.setattr(cost, "calibrate", lambda model, **k: measured.append(1) or first)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        if damage == "foreign-owned":   # the folder stays this user's, the file is another's
            real = os.fstat
            monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result(
                (*real(fd)[:4], os.geteuid() + 1, *real(fd)[5:10])))
        again = cost.load_or_calibrate(MODEL, tmp_path, **SMALL)
    assert again == first and measured == [1]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage(), caplog.text
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize("damage", ["world-writable", "foreign-owned"])
def test_a_calibration_folder_others_can_write_to_is_not_used(tmp_path, caplog, monkeypatch,
                                                              damage):
    folder = tmp_path / damage
    folder.mkdir()
    first = cost.load_or_calibrate(MODEL, folder, **SMALL)
    if damage == "world-writable":
        folder.chmod(0o777)
    else:
        _another_user(monkeypatch)
    measured = []
    monkeypatch.setattr(cost, "calibrate", lambda model, **k: measured.append(1) or first)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        cost.load_or_calibrate(MODEL, folder, **SMALL)
    assert measured == [1]   # its file is neither read nor replaced
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "not using the calibration folder" in warnings[0].getMessage()
