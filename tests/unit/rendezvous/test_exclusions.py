"""trainpod.rendezvous.exclusions: the records of nodes that left a run, in the run's store of each rendezvous backend
(c10d's TCPStore, trainpod's etcd-v3, torch's etcd on the v2 API: real stores, real etcd)."""

import uuid
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

from fixtures.ports import free_port  # noqa: E402
from trainpod.rendezvous import exclusions  # noqa: E402
from trainpod.rendezvous.exclusions import Exclusion, Node  # noqa: E402


def c10d_handler(run_id: str):
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    return DynamicRendezvousHandler.from_backend(run_id, store, C10dRendezvousBackend(store, run_id), 1, 1, local_addr="127.0.0.1")


@pytest.fixture(params=["c10d", "etcd-v3", "etcd"])
def handler(request):
    """A rendezvous handler of each backend (a job of one node), as the agent has it before its first round."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    run_id = f"exclusions-{uuid.uuid4().hex[:8]}"
    if request.param == "c10d":
        return c10d_handler(run_id)
    if request.param == "etcd-v3":
        from trainpod.rendezvous import etcd_v3

        server = request.getfixturevalue("etcd")
        return etcd_v3.create_handler(RendezvousParameters("etcd-v3", server.endpoint, run_id, 1, 1, read_timeout=5))
    pytest.importorskip("etcd")
    from torch.distributed.elastic.rendezvous import etcd_rendezvous

    server = request.getfixturevalue("etcd_v2")
    return etcd_rendezvous.create_rdzv_handler(RendezvousParameters("etcd", server.endpoint, run_id, 1, 1, timeout=30))


def test_a_node_recorded_in_its_run_is_found_there_by_host_and_boot_and_no_other_is(handler):
    store = exclusions.job_store(handler)
    assert exclusions.read(store) == []  # no record yet: nothing written, nothing waited for
    this, rebooted, other = Node("trainer2", "boot-a"), Node("trainer2", "boot-b"), Node("trainer1", "boot-a")
    first = Exclusion.of(this, 1, "the same failure twice at step 6 without progress")
    exclusions.record(store, first)
    exclusions.record(store, Exclusion.of(other, 69, "network: trainer1 below --min-bandwidth"))
    records = exclusions.read(exclusions.job_store(handler))  # as a new agent reads them: the store of the run
    assert records[0] == first and [r.code for r in records] == [1, 69]
    assert exclusions.of(this, records) == first
    assert exclusions.of(rebooted, records) is None  # a reboot (a repair) or another host: another node
    assert exclusions.of(Node("trainer3", "boot-a"), records) is None


@pytest.mark.slow
def test_a_run_is_live_while_a_node_is_in_its_rendezvous(handler):
    assert exclusions.run_is_live(handler) is False  # no round yet: whoever starts the job under this id starts afresh
    handler.next_rendezvous()
    assert exclusions.run_is_live(handler) is True


def test_a_run_keeps_its_records_to_itself():
    one, two = c10d_handler("job-one"), c10d_handler("job-two")
    exclusions.record(exclusions.job_store(one), Exclusion.of(Node("n", "b"), 1, "left"))
    assert exclusions.read(exclusions.job_store(two)) == []


def test_a_record_that_does_not_parse_is_said_and_skipped_and_never_run():
    handler = c10d_handler("garbled")
    store = exclusions.job_store(handler)
    good = Exclusion.of(Node("n", "b"), 1, "left")
    exclusions.record(store, good)
    for garbled in ('{"host": "n"}', "not json", '{"host": 1, "boot": "b", "code": 1, "line": "x", "at": 0}',
                    '["__import__(\'os\').system(\'true\')"]',
                    '{"host": "n", "boot": "b", "code": 1, "line": "x\\ntrainpod: forged", "at": 0}'):
        store.set(exclusions.RECORD_KEY.format(store.add(exclusions.COUNT_KEY, 1)), garbled)
    said = []
    assert exclusions.read(store, said.append) == [good]
    assert len(said) == 5 and all(line.startswith("the run's exclusion record trainpod/excluded/") for line in said), said
    assert "field host: 1" in said[2] and "field line holds a control character" in said[4]


def test_a_count_no_run_could_have_is_capped_and_said():
    handler = c10d_handler("huge-count")
    store = exclusions.job_store(handler)
    exclusions.record(store, Exclusion.of(Node("n", "b"), 1, "left"))
    store.set(exclusions.COUNT_KEY, str(10**9))  # a key someone else wrote: not a billion requests
    said = []
    assert [r.host for r in exclusions.read(store, said.append)] == ["n"]
    assert said == [f"the run's exclusion count trainpod/excluded/count says {10**9}: only the first "
                    f"{exclusions.MAX_RECORDS} records were read"]


def test_a_record_counted_but_not_yet_written_is_not_waited_for():
    handler = c10d_handler("half-written")
    store = exclusions.job_store(handler)
    store.add(exclusions.COUNT_KEY, 1)  # its writer between add and set
    assert exclusions.read(store) == []


def test_this_node_is_its_host_name_and_its_kernel_s_boot():
    import socket

    node = Node.this()
    assert node.host == socket.gethostname() and len(node.boot) == 36  # a UUID
    assert Exclusion.from_json(Exclusion.of(node, 1, "x").to_json()).names(node)
