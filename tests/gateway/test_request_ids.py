"""The gateway's request ids: unique in a process, and a process made by fork does not repeat its parent's."""
import os

from gateway.request_ids import new_request_id


def test_ids_are_unique_hex_of_uuid4s_length():
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_a_forked_child_draws_its_own_prefix():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id, then out without pytest's teardown
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child, parent = os.read(read, 64).decode(), new_request_id()
    assert len(child) == 32 and child[:16] != parent[:16]
