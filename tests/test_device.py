"""Device selection, synchronisation, memory statistics, host copies and the matmul-rate helper."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from mindspeed_core import device, ops


def test_selected_device_is_available():
    assert device.type() in ("cpu", "cuda", "npu")
    assert device.type() in device.available()
    assert device.current().startswith(device.type())
    assert "cpu" in device.available()


def test_select_keeps_the_bound_device_and_refuses_absent_ones():
    from mindspeed_core.errors import BackendError

    assert device.select(device.type()) == device.type()
    absent = [d for d in ("cuda", "npu") if d not in device.available()]
    for name in absent:
        with pytest.raises(BackendError, match="not available"):
            device.select(name)
    assert device.type() in device.available()  # a refused selection changes nothing


def test_synchronize_and_memory_stats():
    x = ops.matmul(ops.ones((64, 64)), ops.ones((64, 64)))
    device.synchronize()
    np.testing.assert_array_equal(ops.to_numpy(x)[0, :3], 64)
    stats = device.memory_stats()
    assert stats["host_rss_bytes"] > 10 * 2 ** 20  # a framework is loaded: at least tens of MiB
    assert stats["host_peak_rss_bytes"] >= stats["host_rss_bytes"]
    if device.type() != "cpu":
        assert stats["allocated_bytes"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
def test_a_copy_to_the_host_and_back_is_exact(dtype):
    x = ops.cast(ops.tensor(np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5), dtype)
    host = device.to_host(x)
    back = device.to_device(host)
    assert ops.dtype_of(back) == dtype and tuple(back.shape) == (3, 4)
    np.testing.assert_array_equal(ops.to_numpy(back), ops.to_numpy(x))


def test_float32_is_always_supported():
    assert device.supports_dtype("float32")


def test_matmul_rate_is_a_plausible_rate():
    rate = device.matmul_rate(n=256, min_seconds=0.2)
    # Even one slow core does far more than 0.1 GFLOP/s, and nothing here reaches 100 TFLOP/s.
    assert 1e8 < rate < 1e14


@pytest.mark.mindspore_process
def test_the_mindspore_backend_sizes_its_thread_pools_by_omp_num_threads():
    """In a process started with OMP_NUM_THREADS=1, MindSpore's kernel and runtime pools are
    set to one thread as the backend is imported (the pools spin waiting for work, and ranks
    sharing cores slow each other down: backends/mindspore/device.py)."""
    pytest.importorskip("mindspore")
    probe = ("from mindspeed_core.backends.mindspore import facade as _\n"
             "from mindspore._c_expression import RuntimeConf\n"
             "c = RuntimeConf.get_instance()\n"
             "print(c.is_op_threads_num_configured(), c.is_dispatch_threads_num_configured())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and out.stdout.split("\n")[-2] == "True True", (out.stdout[-500:], out.stderr[-2000:])
