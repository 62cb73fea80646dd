"""Rescaling keyed state through the agents' state.* ops, without Spark (issue 8): a restart (a new
driver agent) with another parallelism and a change between batches in one application both rebuild
every subtask from the old checkpoint's overlapping subtasks only (reported per subtask in the ack
stats), the values survive 4 -> 2 -> 5, a max-parallelism change is refused naming both values, and
the per-checkpoint upload stats show an incremental checkpoint."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from sparksteward.checkpoint.coordination.driver_service import StateService
from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.checkpoint.task.subtask_restore import overlapping_subtasks
from sparksteward.checkpoint.task.task_state import SubtaskService
from sparksteward.errors import CheckpointOrderError, ParallelismError
from sparksteward.state.keygroups import key_group_range
from sparksteward.wire import AgentServer, Connection, new_secret

from tests.helpers.state import split_by_subtask, write_subtask

pytestmark = pytest.mark.usefixtures("guarded_rmtree")  # deletes stay under tmp_path

M = 16


class App:
    """One "application": a driver agent's StateService and one executor agent, over real sockets."""

    def __init__(self, tmp: Path, tag: str) -> None:
        self.secret = new_secret()
        self.driver = AgentServer("127.0.0.1", 0, self.secret, {})
        self.states = StateService(str(tmp / "chk"), "c1", commit_timeout=30)
        self.states.register_handlers(self.driver)
        self.executor = AgentServer("127.0.0.1", 0, self.secret, {})
        self.subtasks = SubtaskService(tmp / f"exec-{tag}", self.driver.endpoint, self.secret, upload_threads=2)
        self.subtasks.register_handlers(self.executor)
        self.d = Connection.connect(self.driver.endpoint, self.secret)
        self.e = Connection.connect(self.executor.endpoint, self.secret)

    def register(self, parallelism: int, max_parallelism: int = M) -> dict:
        return self.d.request("state.register", name="s", checkpoint_dir=None, parallelism=parallelism,
                              max_parallelism=max_parallelism, key_type="string", num_retained=1)

    def batch(self, cid: int, parallelism: int, delta: dict[str, int]) -> dict:
        """Begin, run every subtask's task, commit; return the commit reply."""
        self.d.request("state.begin", name="s", checkpoint_id=cid, parallelism=parallelism)
        for i, part in enumerate(split_by_subtask(delta, parallelism, M)):
            opened = self.e.request("state.open", name="s", checkpoint_id=cid, subtask=i)
            write_subtask(self.e, opened, i, parallelism, M, part)
        return self.d.request("state.commit", name="s", checkpoint_id=cid, wait=30)

    def close(self) -> None:
        self.d.close()
        self.e.close()
        self.subtasks.close()
        self.executor.close()
        self.driver.close()
        self.states.close()   # the application stops: its leases are released


def values(tmp: Path, meta: dict) -> dict[str, int]:
    from tests.helpers.keyed import read_values

    return {k: int(v) for k, v in read_values(str(tmp / "chk"), "s", "c1", meta)}


def assert_read_only_overlaps(stats: dict, old: dict, new_parallelism: int) -> None:
    """Every new subtask read exactly the files of the old subtasks overlapping its key groups."""
    old_meta = CheckpointMetadata.from_bytes(orjson.dumps(old), "test")
    restores = {r["subtask"]: r for r in stats["restores"]}
    assert sorted(restores) == list(range(new_parallelism))
    for j, r in restores.items():
        overlapping = [h for h, _ in overlapping_subtasks(old_meta, key_group_range(M, new_parallelism, j))]
        assert r["old_parallelism"] == old_meta.parallelism
        assert r["base_checkpoint"] == old_meta.checkpoint_id
        assert [r["base"], *r["ingested_from"]] == [h.subtask for h in overlapping]
        assert r["files_read"] == [f.path for h in overlapping for f in h.files]
        assert r["bytes_read"] == sum(h.size for h in overlapping)
        assert r["bytes_read"] < sum(h.size for h in old_meta.subtasks) or len(overlapping) == len(old_meta.subtasks)


def test_restart_with_another_parallelism_and_a_change_between_batches_rescale(tmp_path):
    keys = {f"k{i}": i for i in range(400)}
    app = App(tmp_path, "a")
    try:
        assert app.register(4)["rescaled_from"] is None
        app.batch(0, 4, keys)
        meta4 = app.batch(1, 4, {k: 1 for k in list(keys)[:50]})["metadata"]
    finally:
        app.close()
    expected = {k: v + (1 if i < 50 else 0) for i, (k, v) in enumerate(keys.items())}
    assert values(tmp_path, meta4) == expected

    app = App(tmp_path, "b")  # a new application: the driver agent recovers the P=4 checkpoint
    try:
        assert app.register(2)["rescaled_from"] == 4
        reply = app.batch(2, 2, {"k0": 100})
        assert reply["metadata"]["parallelism"] == 2 and reply["metadata"]["properties"]["base"] == 1
        assert_read_only_overlaps(reply["stats"], meta4, 2)
        expected["k0"] += 100
        assert values(tmp_path, reply["metadata"]) == expected
        meta2 = reply["metadata"]

        # in the same application, between batches: a new register with parallelism 5
        assert app.register(5)["rescaled_from"] == 2
        with pytest.raises(ParallelismError, match=r"now has parallelism 5 .* routes rows to 2 subtasks"):
            app.d.request("state.begin", name="s", checkpoint_id=3, parallelism=2)  # the old object
        with pytest.raises(ParallelismError, match=r"routed to 2 subtasks, but the state now has parallelism 5"):
            app.e.request("state.open", name="s", checkpoint_id=3, subtask=0, parallelism=2)  # its lazy output
        reply = app.batch(3, 5, {"k1": 7})
        assert_read_only_overlaps(reply["stats"], meta2, 5)
        expected["k1"] += 7
        assert values(tmp_path, reply["metadata"]) == expected
        info = app.d.request("state.info", name="s")
        assert info["parallelism"] == 5
        assert [c["checkpoint_id"] for c in info["checkpoints"]] == [2, 3]
        # the next checkpoint at the same parallelism restores each subtask from its own old one
        reply = app.batch(4, 5, {"k2": 1})
        assert all(r["ingested_from"] == [] and r["base"] == r["subtask"] for r in reply["stats"]["restores"])
    finally:
        app.close()


def test_max_parallelism_change_is_refused_naming_both_values(tmp_path):
    app = App(tmp_path, "a")
    try:
        app.register(2)
        app.batch(0, 2, {"a": 1})
        with pytest.raises(ParallelismError, match=r"has max_parallelism=16 and cannot be opened with "
                                                    r"max_parallelism=32.*Keep max_parallelism=16"):
            app.register(2, max_parallelism=32)
        with pytest.raises(ParallelismError, match=r"has max_parallelism=16 and cannot be opened with "
                                                    r"max_parallelism=32"):
            app.d.request("state.check", name="s", checkpoint_dir=None, max_parallelism=32)
    finally:
        app.close()
    app = App(tmp_path, "b")  # a restart with another max parallelism
    try:
        with pytest.raises(ParallelismError, match=r"checkpointed with max_parallelism=16 \(checkpoint 0\) and "
                                                    r"cannot be restored with max_parallelism=8.*Keep "
                                                    r"max_parallelism=16"):
            app.register(2, max_parallelism=8)
    finally:
        app.close()


def test_parallelism_cannot_change_while_a_checkpoint_is_pending(tmp_path):
    app = App(tmp_path, "a")
    try:
        app.register(2)
        app.d.request("state.begin", name="s", checkpoint_id=0, parallelism=2)
        with pytest.raises(CheckpointOrderError, match=r"cannot change parallelism 2 -> 3 while checkpoints \[0\] "
                                                       r"are pending: commit or abort them first"):
            app.register(3)
        app.d.request("state.abort", name="s", checkpoint_id=0)
        assert app.register(3)["rescaled_from"] is None  # nothing checkpointed yet
        app.batch(0, 3, {"a": 1})
    finally:
        app.close()


def test_checkpoint_stats_show_incremental_uploads(tmp_path):
    app = App(tmp_path, "a")
    try:
        app.register(2)
        keys = {f"key-{i:06d}": i for i in range(20_000)}
        first = app.batch(0, 2, keys)["stats"]
        later = [app.batch(c, 2, {f"key-{c * 7 + i:06d}": 1 for i in range(200)})["stats"] for c in (1, 2, 3)]
        print(f"\nuploaded per checkpoint: {[(s['files_uploaded'], s['bytes_uploaded']) for s in [first, *later]]}")
        assert first["subtasks"] == 2 and first["files_reused"] == 0
        assert first["files_uploaded"] == first["files"] and first["bytes_uploaded"] == first["bytes"]
        for s in later:
            assert s["files_reused"] > 0 and s["bytes_uploaded"] < first["bytes_uploaded"] / 5
            assert s["files_uploaded"] + s["files_reused"] == s["files"]
        info = app.d.request("state.info", name="s")
        assert [c["bytes_uploaded"] for c in info["checkpoints"]] == [s["bytes_uploaded"] for s in [first, *later]]
    finally:
        app.close()


def test_declarations_survive_a_restart_evolve_and_are_read_before_the_first_batch(tmp_path):
    """Application a declares a struct value state and writes it; application b (real agents, a new
    driver agent) reads it before any batch, refuses a narrowing by name, and opens it evolved."""
    from sparksteward.errors import StateSchemaError
    from sparksteward.keyed_tasks import read_table
    from sparksteward.state.declared import value_state
    from sparksteward.state.typed import TypedStates

    v1 = [value_state("last", "v int, note string").to_json()]
    app = App(tmp_path, "a")
    try:
        reply = app.d.request("state.register", name="s", checkpoint_dir=None, parallelism=2, max_parallelism=M,
                              key_type="string", num_retained=1, states=v1)
        record = reply["states"]
        app.d.request("state.begin", name="s", checkpoint_id=0, parallelism=2)
        for i, part in enumerate(split_by_subtask({"a": 1, "b": 2, "c": 3}, 2, M)):
            opened = app.e.request("state.open", name="s", checkpoint_id=0, subtask=i)

            def extra(backend, part=part):
                TypedStates(backend, record, 0, 0).value("last").put_many(
                    list(part), [{"v": d, "note": "x"} for d in part.values()])

            write_subtask(app.e, opened, i, 2, M, part, extra)
        app.d.request("state.commit", name="s", checkpoint_id=0, wait=30)
    finally:
        app.close()
    app = App(tmp_path, "b")
    try:
        checked = app.d.request("state.check", name="s", checkpoint_dir=None, max_parallelism=M)
        assert checked["latest"]["properties"]["states"]["variables"]["last"]["current"] == 1
        table = read_table(checked["checkpoint_dir"], "s", checked["cluster_id"], checked["latest"], "last")
        assert sorted(table.to_pylist(), key=lambda r: r["key"]) == [
            {"key": k, "value": {"v": d, "note": "x"}} for k, d in (("a", 1), ("b", 2), ("c", 3))]
        with pytest.raises(StateSchemaError, match=r"keyed state 's': state variable 'last' cannot be read as "
                                                   r"declared: version 1 of its values has type .* field 'v' "
                                                   r"changed from int32 to int16"):
            app.d.request("state.register", name="s", checkpoint_dir=None, parallelism=2, max_parallelism=M,
                          key_type="string", states=[value_state("last", "v smallint").to_json()])
        reply = app.d.request("state.register", name="s", checkpoint_dir=None, parallelism=2, max_parallelism=M,
                              key_type="string", states=[value_state("last", "v bigint, w double").to_json()])
        assert reply["states"]["variables"]["last"]["current"] == 2
        reply = app.batch(1, 2, {"a": 1})
        assert reply["metadata"]["properties"]["states"]["variables"]["last"]["types"].keys() == {"1", "2"}
        table = read_table(str(tmp_path / "chk"), "s", "c1", reply["metadata"], "last")
        assert sorted(table.to_pylist(), key=lambda r: r["key"])[0] == {"key": "a", "value": {"v": 1, "w": None}}
    finally:
        app.close()


T0 = 1_800_000_000_000


def register_declared(app: App, **fields) -> dict:
    reply = app.d.request("state.register", name="s", checkpoint_dir=None, parallelism=2, max_parallelism=M,
                          key_type="string", num_retained=2, **fields)
    app.record = reply["states"]   # type: ignore[attr-defined]
    return reply


def declared_batch(app: App, cid: int, keys: list[str], work) -> tuple[dict, dict]:
    """One batch as a KeyedState and its tasks run it: ``state.begin``, then in every subtask the drop
    of the variables the begun record lists (keyed_tasks) before ``work(states, keys, backend)`` over
    the typed views of that record, then ``state.commit``. Returns the begin and commit replies."""
    from sparksteward.state.typed import TypedStates, drop_variables

    begun = app.d.request("state.begin", name="s", checkpoint_id=cid, parallelism=2)
    record = begun.get("states", app.record)   # what KeyedState hands its tasks: the record as of this begin
    for i, part in enumerate(split_by_subtask(dict.fromkeys(keys, 0), 2, M)):
        opened = app.e.request("state.open", name="s", checkpoint_id=cid, subtask=i)

        def extra(backend, part=part):
            if record.get("dropped"):
                drop_variables(backend, record["dropped"])
            work(TypedStates(backend, record, T0, cid), sorted(part), backend)

        write_subtask(app.e, opened, i, 2, M, {}, extra)
    return begun, app.d.request("state.commit", name="s", checkpoint_id=cid, wait=30)


def names_in(backend) -> set[str]:
    from sparksteward.state.encoding import split_key
    from sparksteward.state.typed import KIND_EXPIRY

    return {split_key(k[:2] + k[11:] if k[2:3] == KIND_EXPIRY else k)[2] for k, _ in backend.iter_raw()}


KEYS = ["a", "b", "c", "d"]


def write_x(states, keys, backend):
    if keys:
        states.value("x").put_many(keys, ["abcd"] * len(keys))


def test_a_second_open_keeps_delete_states_and_a_name_declared_anew_never_reads_old_bytes(tmp_path):
    """Issue 35 item 11, with real agents: application b opens the state with delete_states=["x"] twice
    (a notebook cell run again): the second open still drops x, the tasks of its next batch delete x's
    entries, and the checkpoint records the drop and x's last version. Application c declares x anew as
    a bigint: it gets version 2, and the old string 'abcd' never reads as the bigint
    7233733595238498308."""
    from sparksteward.keyed_tasks import read_table
    from sparksteward.state.declared import value_state

    app = App(tmp_path, "a")
    try:
        register_declared(app, states=[value_state("x", "string").to_json(), value_state("n", "bigint").to_json()])
        declared_batch(app, 0, KEYS, write_x)
    finally:
        app.close()
    app = App(tmp_path, "b")
    try:
        first = register_declared(app, delete_states=["x"])
        second = register_declared(app, delete_states=["x"])
        assert first["states"]["dropped"] == second["states"]["dropped"] == ["x"]
        seen: list[set[str]] = []

        def check_dropped(states, keys, backend):
            seen.append(names_in(backend))

        begun, done = declared_batch(app, 1, KEYS, check_dropped)
        assert begun["states"]["dropped"] == ["x"] and len(seen) == 2 and all("x" not in s for s in seen)
        recorded = done["metadata"]["properties"]["states"]
        assert "x" not in recorded["variables"] and recorded["deleted"]["x"] == {"kind": "value", "current": 1}
        begun, _ = declared_batch(app, 2, KEYS, lambda *a: None)
        assert begun["states"]["dropped"] == []     # ran and completed: not run again
    finally:
        app.close()
    app = App(tmp_path, "c")
    try:
        reply = register_declared(app, states=[value_state("x", "bigint").to_json()])
        assert reply["states"]["variables"]["x"]["current"] == 2
        got: list = []

        def read_then_write(states, keys, backend):
            got.extend(states.value("x").get_many(keys).to_pylist())
            states.value("x").put_many(keys, [5] * len(keys))

        _, done = declared_batch(app, 3, KEYS, read_then_write)
        assert got == [None] * len(KEYS)
        table = read_table(str(tmp_path / "chk"), "s", "c1", done["metadata"], "x")
        assert sorted(table.to_pylist(), key=lambda r: r["key"]) == [{"key": k, "value": 5} for k in KEYS]
    finally:
        app.close()


def test_a_redelivered_batch_with_delete_states_newly_added_keeps_the_drop_until_it_ran(tmp_path):
    """Issue 35 item 11: the driver died after committing batch 1; the restarted application opens the
    state with delete_states=["x"] newly added and Spark delivers batch 1 again. Its re-run keeps the
    first result (with x's entries), so the drop stays pending: batch 2's tasks run it, and only the
    checkpoint of those tasks records it as done."""
    from sparksteward.state.declared import value_state

    app = App(tmp_path, "a")
    try:
        register_declared(app, states=[value_state("x", "string").to_json()])
        declared_batch(app, 0, KEYS, write_x)
        declared_batch(app, 1, KEYS, write_x)
    finally:
        app.close()
    app = App(tmp_path, "b")
    try:
        assert register_declared(app, delete_states=["x"])["states"]["dropped"] == ["x"]
        begun, done = declared_batch(app, 1, KEYS, lambda *a: None)   # the re-delivered batch
        assert begun["rerun"] and "x" in done["metadata"]["properties"]["states"]["variables"]
        before: list[set[str]] = []

        def check(states, keys, backend):
            before.append(names_in(backend))

        begun, done = declared_batch(app, 2, KEYS, check)
        assert len(before) == 2 and all("x" not in s for s in before)
        recorded = done["metadata"]["properties"].get("states")
        assert recorded is not None and recorded["variables"] == {}
        assert recorded["deleted"] == {"x": {"kind": "value", "current": 1}}
        assert begun["states"]["dropped"] == ["x"]
        assert register_declared(app, states=[value_state("x", "bigint").to_json()])["states"]["variables"]["x"][
            "current"] == 2
    finally:
        app.close()
