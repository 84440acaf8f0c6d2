import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from gdsckpt.writing.snapshot import host as hs
# The S3 fixtures, here so that the whole session shares one server (a test module that imports
# a fixture gets a definition, and so a server, of its own: 12 servers, 4-9 s each to start).
from s3_server import s3_env, s3_server, silent_endpoint  # noqa: E402,F401 - fixtures

# Folders whose modules other tests import (this file's helpers, test_manager's states, the
# corruption tools): on sys.path here (pyproject's `pythonpath`) and on the PYTHONPATH of every
# child a test starts, so that a child's `from test_manager import state_for` finds them too.
SHARED_FOLDERS = [Path(__file__).parent / sub for sub in ("", "manager", "reading", "cli")]
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(p) for p in SHARED_FOLDERS] + [p for p in [os.environ.get("PYTHONPATH")] if p])


def _gpu_ready() -> tuple[bool, str]:
    from gdsckpt.engine.backend import gpu_status
    return gpu_status()


def pytest_configure(config):
    """codec="auto" on the CPU compresses in every test process, whatever cores the runner has (on
    a host of few cores it stores raw: defaults.CPU_AUTO_COMPRESS_MIN_CORES), so that tests and
    goldens of the compressed format mean the same on every runner; test_codec_choice sets it
    back to test that choice."""
    from gdsckpt.core import defaults
    defaults.CPU_AUTO_COMPRESS_MIN_CORES = 1


# Files whose every test is `integration`: they start other processes (torchrun and gloo ranks,
# SIGKILLed writers, the CLI, DCP's), a real S3 server (SeaweedFS), or train with a framework.
# `scripts/test.sh --quick` runs the rest (-m "not slow and not integration"); tests/README.md
# says how long each takes.
INTEGRATION_FILES = frozenset({
    "test_bench.py", "test_bench_cli.py", "test_bench_memory.py", "test_bench_train.py",
    "test_cli.py", "test_cli_export.py", "test_cli_files.py", "test_cli_output.py",
    "test_dcp.py", "test_dcp_cache.py", "test_dcp_gpu.py", "test_dcp_metadata.py", "test_manager_dcp.py",
    "test_memory_dcp.py",
    "test_integrations_accelerate.py", "test_integrations_accelerate_nodes.py", "test_integrations_lightning.py",
    "test_integrations_torchtitan.py", "test_integrations_transformers.py", "test_integrations_deepspeed.py",
    "test_integrations_megatron.py", "test_integrations_megatron_gpu.py",
    "test_isolated.py", "test_package.py", "test_readme.py", "test_resume.py", "test_writer_crash.py",
    "test_manager_remote.py", "test_reader_remote.py", "test_remote_tier.py", "test_stores.py",
    "test_peer_replicas.py", "test_peer_replicas_torchrun.py", "test_manager_dcp_ranks.py", "test_step_links.py", "test_cli_startup.py",
})


# Tests that take seconds each (3 s or more in a run on the loaded 2-core host): they kill or start
# processes, wait out timeouts, start the S3 server, or run many randomized cases. Marked `slow`
# here, by file and name (every parametrization), so that --quick leaves them out; a new test
# can say so itself with @pytest.mark.slow.
SLOW_TESTS = {
    "test_manager.py": {"test_sigkill_during_save_leaves_an_intact_step", "test_full_disk_keeps_previous_steps",
                        "test_two_managers_on_one_directory"},
    "test_manager_lifecycle.py": {"test_a_read_only_directory_is_opened_to_restore",
                                  "test_a_failed_save_async_seen_by_the_caller_is_not_raised_again",
                                  "test_a_failed_save_async_nobody_looked_at_is_raised_once",
                                  "test_close_without_waiting_keeps_the_lock_while_an_upload_runs",
                                  "test_a_stale_lock_is_named_as_such"},
    "test_manager_restore.py": {"test_dcp_step_with_a_damaged_metadata_falls_back"},
    "test_manager_rollback.py": {"test_rollback_with_the_store_down_is_finished_before_any_upload",
                                 "test_rollback_is_not_undone_by_the_store",
                                 "test_a_killed_rollback_is_finished_by_the_next_manager"},
    "test_memory_tier.py": {"test_sigkill_at_random_moments_then_restore_from_memory",
                            "test_uploads_follow_the_steps_written_to_the_directory",
                            "test_copies_of_an_abandoned_run_never_shadow_the_steps_written_without_them",
                            "test_sigkill_then_a_new_process_restores_from_memory",
                            "test_killed_mid_write_leaves_nothing_restored_and_is_reclaimed"},
    "test_reader.py": {"test_a_store_object_reads_as_the_file_does"},
    "test_reader_contract.py": {"test_trusted_false_decodes_in_a_child",
                                "test_trusted_false_fault_in_the_child_names_the_chunk_and_spares_the_parent",
                                "test_verify_isolated_cli", "test_trusted_false_child_that_dies_or_hangs"},
    "test_reader_corruption.py": {"test_randomized_damage"},
    "test_reserve.py": {"test_a_reserved_slot_is_never_restored_and_is_reclaimed_after_a_kill"},
    "test_save_async.py": {"test_a_save_async_the_process_exits_after_is_committed"},
    "test_sources.py": {"test_a_store_object_reads_ranges_of_the_object"},
    "test_storage.py": {"test_a_killed_save_leaves_a_temporary_that_is_stale"},
    "test_tree_format_properties.py": {"test_state_tree_round_trip", "test_index_validation_on_mutated_indices",
                                       "test_index_parser_on_arbitrary_signed_bytes"},
    "test_writer_failures.py": {"test_two_writer_processes_and_a_reader", "test_file_size_limit_in_a_subprocess"},
    "test_collector.py": {"test_saves_and_loads_leave_no_tensor_in_a_reference_cycle"},
    "test_codec_choice.py": {"test_the_sampler_compresses_the_streams_own_bytes_piece_by_piece"},
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in INTEGRATION_FILES:
            item.add_marker(pytest.mark.integration)
        if item.originalname in SLOW_TESTS.get(item.path.name, ()):
            item.add_marker(pytest.mark.slow)
    ok, why = _gpu_ready()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU with nvCOMP and KvikIO: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_save_in_flight(monkeypatch):
    """After the test: no save_async in flight, no failure left unseen, the pools freed (so the next
    test starts fresh). It asks for monkeypatch so that the test's patches are undone after it."""
    from concurrent.futures import wait

    from gdsckpt.engine import pinned_pool
    from gdsckpt.writing import async_save
    from gdsckpt.writing.snapshot import overlap
    yield
    for fut, _, _ in list(async_save._tracked):
        wait([fut], timeout=30)
        fut.observed = True
    async_save._tracked.clear()
    overlap.wait_for_snapshot(30)
    pinned_pool.release_pools()


def assert_same(a, b, where="<root>"):
    """Bit-exact equality of two state trees: tensors by bytes, floats by repr (NaN, -0.0, inf),
    container types exact except that any dict equals any dict (model.state_dict() is an OrderedDict)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        ab = a.detach().cpu().resolve_conj().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().cpu().resolve_conj().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(ab, bb), f"tensor bytes differ at {where}"
        return
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (where, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b) and [type(k) for k in a] == [type(k) for k in b], where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float):
        assert repr(a) == repr(b), (where, a, b)
    else:
        assert a == b, (where, a, b)


def same(a, b) -> bool:
    """assert_same as a predicate: for tests that accept any one of several states."""
    try:
        assert_same(a, b)
        return True
    except AssertionError:
        return False


def all_dtype_tensors(device="cpu", n=1000, seed=0):
    """One tensor of every dtype gdsckpt stores, with real (non-zero) data."""
    from gdsckpt.core.dtypes import BY_NAME
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, dt in BY_NAME.items():
        raw = torch.randint(0, 256, (n * dt.itemsize,), dtype=torch.uint8, generator=g)
        if dt.is_floating_point and dt.itemsize >= 2:
            t = (torch.randn(n, generator=g) * 3).to(dt)  # realistic floats, not random bit patterns
        elif dt == torch.bool:
            t = raw[:n] > 127
        else:
            t = raw.view(dt)[:n].clone()
        out[name] = t.to(device)
    return out


class SlowSnapshot:
    """Holds the snapshot's first chunk copy until released: the overlap snapshot is then still
    running when the test trains."""

    def __init__(self, monkeypatch):
        self.gate = threading.Event()
        self.started = threading.Event()
        real = hs.PoolFile.pwrite

        def pwrite(file, *a):
            self.started.set()
            assert self.gate.wait(30)
            return real(file, *a)

        monkeypatch.setattr(hs.PoolFile, "pwrite", pwrite)


def tensors_of(obj):
    """Every tensor in a nested state of dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_of(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_of(v)


@pytest.fixture
def shm(monkeypatch):
    """The memory tier's root in a fresh /dev/shm folder, removed after the test."""
    root = Path(tempfile.mkdtemp(prefix="gdsckpt-test-", dir="/dev/shm"))
    monkeypatch.setenv("GDSCKPT_MEMORY_ROOT", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def shm_tmp():
    """A temporary folder in /dev/shm (a memory tier's own file system), removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="gdsckpt-test-", dir="/dev/shm"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
