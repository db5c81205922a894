"""Memory probes: figures from the right counters, with their source named."""

from __future__ import annotations

import math
import subprocess
import sys

import psutil
import pytest
import torch

from engine.measure.memory import (
    AVAILABLE_MEMORY_ENV,
    available_memory_bytes,
    device_name,
    measure_memory_bandwidth,
    probe_memory,
)

CPU = torch.device("cpu")


def test_cpu_probe_is_process_rss_against_system_ram():
    process, reserved, total, source = probe_memory(CPU)
    assert source == "psutil RSS"
    assert process == reserved and 0 < process < total
    assert total == psutil.virtual_memory().total


def test_cpu_probe_sees_a_new_allocation():
    # In a fresh process: inside the test run, memory freed by earlier tests can be handed back
    # to this allocation without the RSS moving.
    script = (
        "import torch; from engine.measure.memory import probe_memory\n"
        "cpu = torch.device('cpu'); before = probe_memory(cpu)[0]\n"
        "block = torch.ones(64 * 2**20)  # 256 MiB, every page written\n"
        "print(probe_memory(cpu)[0] - before)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert int(out.stdout.strip()) >= 200 * 2**20


def test_available_memory_override(monkeypatch):
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "12345")
    assert available_memory_bytes(CPU) == 12345
    monkeypatch.setenv(AVAILABLE_MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match="whole number of bytes"):
        available_memory_bytes(CPU)


def test_available_memory_is_within_the_machine(monkeypatch):
    monkeypatch.delenv(AVAILABLE_MEMORY_ENV, raising=False)
    assert 0 < available_memory_bytes(CPU) <= psutil.virtual_memory().total


def test_bandwidth_is_a_positive_rate():
    rate = measure_memory_bandwidth(CPU, nbytes=8 * 2**20, repeats=2)
    assert math.isfinite(rate) and rate > 0


def test_cpu_name():
    name = device_name(CPU)
    assert name and name.endswith("threads)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_probe_counts_allocator_bytes():
    gpu = torch.device("cuda")
    before, _, total, source = probe_memory(gpu)
    block = torch.empty(2**20, dtype=torch.float32, device=gpu)
    after, reserved, _, _ = probe_memory(gpu)
    assert after - before >= 4 * 2**20 and reserved >= after
    assert total == torch.cuda.get_device_properties(gpu).total_memory or "NVML" in source
    assert source.startswith("torch.cuda allocator")
    assert device_name(gpu) == torch.cuda.get_device_name(gpu)
    del block
