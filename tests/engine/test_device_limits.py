"""Device limits: measured figures hang together, and the per-device cache measures once, reads
back, refreshes on request and re-measures when it is stale or unreadable."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import ConfigError
from engine.measure import device_limits
from engine.measure.device_limits import cache_path, load_or_measure, measure_device_limits
from engine.measure.memory import device_name

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def quick_and_isolated(monkeypatch, tmp_path):
    """Small matmuls and copies (the logic, not the figures, is under test) in a private cache."""
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(device_limits, "MATMUL_SIZES", (32, 64, 128))
    monkeypatch.setattr(device_limits, "BANDWIDTH_BYTES", 4 * 2**20)


@pytest.fixture
def measurements(monkeypatch):
    """Counts real measurements made through load_or_measure."""
    made = []
    real = device_limits.measure_device_limits

    def counting(device, dtype):
        made.append((device, dtype))
        return real(device, dtype)

    monkeypatch.setattr(device_limits, "measure_device_limits", counting)
    return made


def test_measured_limits_hang_together():
    limits = measure_device_limits("cpu", "float32")
    assert limits.device == "cpu" and limits.dtype == "float32"
    assert limits.device_name == device_name(CPU)
    assert limits.peak_flops > 0 and limits.bandwidth > 0
    assert limits.matmul_size in device_limits.MATMUL_SIZES
    assert limits.ridge == limits.peak_flops / limits.bandwidth
    assert limits.threads == torch.get_num_threads()


def test_the_ladder_stops_after_a_slow_matmul(monkeypatch):
    monkeypatch.setattr(device_limits, "SLOW_MATMUL_S", 0.0)  # every matmul counts as slow
    assert measure_device_limits(CPU, "float32").matmul_size == 32


def test_measure_once_then_read_back_then_refresh(measurements):
    first = load_or_measure("cpu", "float32")
    path = cache_path(CPU, "float32")
    assert len(measurements) == 1 and path.is_file()
    stored = json.loads(path.read_text())
    assert stored["peak_flops"] == first.peak_flops and stored["ridge_flops_per_byte"] == first.ridge

    assert load_or_measure("cpu", "float32") == first
    assert len(measurements) == 1  # read back, not measured again

    refreshed = load_or_measure("cpu", "float32", refresh=True)
    assert len(measurements) == 2
    assert json.loads(path.read_text())["peak_flops"] == refreshed.peak_flops
    assert load_or_measure("cpu", "float32") == refreshed


def test_each_dtype_has_its_own_entry(measurements):
    load_or_measure("cpu", "float32")
    bf16 = load_or_measure("cpu", "bfloat16")
    assert len(measurements) == 2 and bf16.dtype == "bfloat16"
    assert cache_path(CPU, "bfloat16") != cache_path(CPU, "float32")


def test_unreadable_or_stale_cache_is_measured_again(measurements):
    load_or_measure("cpu", "float32")
    path = cache_path(CPU, "float32")
    path.write_text("{ half a file")
    load_or_measure("cpu", "float32")
    assert len(measurements) == 2

    # Measured with another thread count: a CPU's peak scales with threads, so it is stale.
    stored = json.loads(path.read_text())
    stored["threads"] = torch.get_num_threads() + 1
    path.write_text(json.dumps(stored))
    load_or_measure("cpu", "float32")
    assert len(measurements) == 3

    stored = json.loads(path.read_text())
    stored["device_name"] = "some other processor"
    path.write_text(json.dumps(stored))
    assert load_or_measure("cpu", "float32").device_name == device_name(CPU)
    assert len(measurements) == 4


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ConfigError, match="dtype must be one of"):
        load_or_measure("cpu", "float64")
