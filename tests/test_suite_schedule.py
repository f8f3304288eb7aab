"""The suite's own set-up (tests/conftest.py): the order xdist hands files out in, XLA's optimisation level and
Ray's worker priority."""

import os
from pathlib import Path
from types import SimpleNamespace

import conftest


def items_of(files: dict[str, int]) -> list:
    return [SimpleNamespace(path=Path("tests") / name, nodeid=f"tests/{name}::t{i}")
            for name, n in files.items() for i in range(n)]


def test_long_files_go_first_then_the_rest_by_number_of_tests(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    files = {"test_a.py": 2, "test_ray_data.py": 3, "test_b.py": 5, "test_bench_gpu.py": 1, "test_c.py": 5}
    items = items_of(files)
    conftest.pytest_collection_modifyitems(None, items)
    order = [i.nodeid for i in items]
    assert list(dict.fromkeys(i.path.name for i in items)) == [
        "test_bench_gpu.py", "test_ray_data.py", "test_b.py", "test_c.py", "test_a.py"]
    assert sorted(order) == sorted(i.nodeid for i in items_of(files))  # nothing lost or repeated
    for name, count in files.items():  # each file's tests keep their order, side by side
        mine = [k for k, n in enumerate(order) if n.startswith(f"tests/{name}::")]
        assert [order[k] for k in mine] == [f"tests/{name}::t{i}" for i in range(count)]
        assert mine == list(range(mine[0], mine[0] + len(mine)))


def test_a_serial_run_keeps_the_collection_order(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    items = items_of({"test_a.py": 1, "test_bench_gpu.py": 1})
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.path.name for i in items] == ["test_a.py", "test_bench_gpu.py"]


def test_xdist_keeps_the_collection_order():
    option = SimpleNamespace(loadscopereorder=True)
    conftest.pytest_configure(SimpleNamespace(option=option))
    assert option.loadscopereorder is False


def test_xla_compiles_at_the_lowest_backend_level_in_every_process_the_tests_start():
    """Set in the environment (subprocesses inherit it), unless the shell's XLA_FLAGS named a level."""
    assert "--xla_backend_optimization_level=" in os.environ["XLA_FLAGS"]


def test_ray_workers_run_at_the_suites_priority():
    """Ray's default (nice 15) starves its actors beside the other xdist workers; the clusters tests start read this."""
    assert os.environ["RAY_worker_niceness"] == "0"
