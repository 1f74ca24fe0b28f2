"""The per-attempt namespace of the ``torchrun`` agent's store (single process, threads).

A ``torchrun --max-restarts`` restart keeps the agent's store and the keys of the failed
attempt; the ranks of the next attempt must agree on a new namespace, not on the old one.
"""

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from physicsnemo_foldcp.distributed import bootstrap

TIMEOUT = timedelta(seconds=20)


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, 1, True, TIMEOUT, wait_for_workers=False)


def client(server):
    return dist.TCPStore("127.0.0.1", server.port, 1, False, TIMEOUT)


def attempt(server, world_size, *, rank0_delay=None):
    """Every rank's token, rank 0 starting once ``rank0_delay`` (an Event) is set."""
    tokens: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(rank):
        try:
            if rank == 0 and rank0_delay is not None:
                assert rank0_delay.wait(TIMEOUT.total_seconds())
            tokens[rank] = bootstrap._attempt_token(client(server), rank, world_size, TIMEOUT)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    return threads, tokens, errors


def finish(threads, errors):
    for t in threads:
        t.join(TIMEOUT.total_seconds() + 5)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def test_ranks_agree_on_a_new_token_each_attempt(server):
    threads, first, errors = attempt(server, 3)
    finish(threads, errors)
    assert len(set(first.values())) == 1

    # The next attempt: ranks 1 and 2 start first, find the earlier token and join it.
    stale = [f"{bootstrap._ATTEMPT_NAMESPACE}/{first[0]}/join/{r}" for r in (1, 2)]
    earlier = server.multi_get(stale)
    go = threading.Event()
    threads, second, errors = attempt(server, 3, rank0_delay=go)
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while any(a == b for a, b in zip(server.multi_get(stale), earlier, strict=True)):
        assert time.monotonic() < deadline, "ranks 1 and 2 did not join the earlier token"
        time.sleep(0.01)
    go.set()
    finish(threads, errors)
    assert len(set(second.values())) == 1
    assert second[0] != first[0]


def test_a_rank_without_rank_0_gets_a_clear_error(server):
    with pytest.raises(RuntimeError, match="rank 1 got no answer from rank 0 within 0.3 s"):
        bootstrap._attempt_token(client(server), 1, 2, timedelta(seconds=0.3))


def test_rank_0_names_the_ranks_that_did_not_join(server):
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1, 2\] did not join the job within 0.3 s"):
        bootstrap._attempt_token(client(server), 0, 3, timedelta(seconds=0.3))


def test_no_agent_store_leaves_the_default(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert bootstrap._attempt_store(0, 1, TIMEOUT) is None


def test_the_agent_store_gets_this_attempts_prefix(server, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    store, rank, world_size = bootstrap._attempt_store(0, 1, TIMEOUT)
    assert (rank, world_size) == (0, 1)
    store.set("k", "v")
    token = server.get(f"{bootstrap._ATTEMPT_NAMESPACE}/token").decode()
    assert server.get(f"{bootstrap._ATTEMPT_NAMESPACE}/{token}/default_pg/k") == b"v"
