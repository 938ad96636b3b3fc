"""The launcher's stub supervisor (launcher/stack.py StubSupervisor) without Triton (issue 27): what it asks
of the server for each death, however many and however close; the real server: tests/launcher/test_lifecycle.py."""
import threading
import time
import urllib.error
from types import SimpleNamespace

import pytest

import launcher.stack as stack_module
from launcher.stack import StubSupervisor

ENGINE = "tensorrt_llm"


class FakeProc:
    def __init__(self, pid):
        self.pid, self.code = pid, None

    def poll(self):
        return self.code


class FakeStack:
    """What the supervisor uses of `Stack`, over a fake server: `stubs` (model -> pids) is what /proc would
    show, `states` what Triton's repository index says, `on_load(model)` what a load does."""

    def __init__(self, stubs):
        self.cfg = SimpleNamespace(repo=None)
        self.stopping = threading.Event()
        self.triton = FakeProc(1000)
        self.reloads, self.triton_restarts, self.loads = [], [], []
        self.stubs = dict(stubs)
        self._stubs_at_start = dict(stubs)
        self._triton_lock = threading.Lock()
        self.states: dict[str, str] = {}
        self.on_load = lambda model: None
        self.on_restart = lambda: True
        self.live = True  # what /v2/health/live says

    def server_live(self):
        return self.live

    def model_states(self):
        return dict(self.states)

    def reload_model(self, model, timeout=600):
        self.loads.append(model)
        self.on_load(model)

    def restart_triton(self, why, hung=None):
        self.triton_restarts.append(why)
        self.triton = FakeProc(self.triton.pid + 1)
        return self.on_restart()


@pytest.fixture
def world(monkeypatch):
    stack = FakeStack({ENGINE: frozenset({10}), "gateway": frozenset({20})})
    monkeypatch.setattr(stack_module, "python_models", lambda repo: sorted(stack.stubs))
    monkeypatch.setattr(stack_module, "stub_pids", lambda pid: {m: p for m, p in stack.stubs.items() if p})
    monkeypatch.setattr(stack_module, "_kill_group", lambda proc: setattr(proc, "code", -9))
    monkeypatch.setattr(StubSupervisor, "POLL_S", 0.01)
    monkeypatch.setattr(StubSupervisor, "SETTLE_S", 0.02)
    return stack


def test_each_death_far_apart_gets_one_unload_and_load_and_the_new_stub_is_watched(world):
    pids = iter(range(11, 100))
    world.on_load = lambda model: world.stubs.__setitem__(model, frozenset({next(pids)}))
    sup = StubSupervisor(world)
    sup.step()
    assert world.loads == []
    for n in (1, 2, 3):  # the second and later deaths are what Triton's plain `load` ignored
        world.stubs[ENGINE] = frozenset()
        sup.step()
        sup.step()
        assert world.loads == [ENGINE] * n and world.reloads == [ENGINE] * n
        assert sup.up[ENGINE] == world.stubs[ENGINE] and not sup.down
    world.stubs[ENGINE] = frozenset({99})  # replaced by something else (the backend's own restart): a death
    sup.step()
    assert world.loads == [ENGINE] * 4


def test_a_stub_on_its_way_out_after_a_reload_is_not_a_death(world, monkeypatch):
    """The backend's own restart of a stub can overlap a reload: right after it, two stubs, the older of
    which exits a moment later. Only the one that stays is watched: no second reload, no loop."""
    monkeypatch.setattr(StubSupervisor, "SETTLE_S", 0.3)

    def load(model):
        world.stubs[model] = frozenset({11, 12})
        threading.Timer(0.1, lambda: world.stubs.__setitem__(model, frozenset({12}))).start()
    world.on_load = load
    sup = StubSupervisor(world)
    world.stubs[ENGINE] = frozenset()
    sup.step()
    assert world.loads == [ENGINE] and sup.up[ENGINE] == frozenset({12})
    for _ in range(5):
        sup.step()
    assert world.loads == [ENGINE]


def test_a_reload_that_keeps_failing_is_retried_with_growing_pauses_never_in_a_loop(world, capsys):
    def fails(model):
        raise urllib.error.URLError("load failed for model 'tensorrt_llm': Stub process is not healthy")
    world.on_load = fails
    clock = [0.0]
    sup = StubSupervisor(world, clock=lambda: clock[0])
    world.stubs[ENGINE] = frozenset()
    while clock[0] < 60:  # a minute of the supervisor's 0.5 s polls
        sup.step()
        clock[0] += 0.5
    assert len(world.loads) == 6  # at 0, 1, 3, 8, 18, 48 s: not 120 attempts, not 2 a second
    # the death is said once (counted by this fake stub's pid: a real stack's supervisor thread left by an
    # earlier test module of the same run may print its own lines into the captured stderr)
    assert capsys.readouterr().err.count("(pid 10) died") == 1
    world.on_load = lambda model: world.stubs.__setitem__(model, frozenset({11}))
    clock[0] += 30
    sup.step()
    assert world.reloads == [ENGINE] and sup.up[ENGINE] == {11}


def test_no_load_is_asked_while_one_is_in_flight(world):
    sup = StubSupervisor(world)
    world.stubs[ENGINE] = frozenset({12})  # the stub of a load in flight (ours timed out meanwhile)
    world.states[ENGINE] = "LOADING"
    sup.up.pop(ENGINE)
    sup.down[ENGINE] = (1, 0.0)
    for _ in range(5):
        sup.step()
    assert world.loads == [] and not world.triton_restarts


def test_a_model_whose_stub_is_gone_right_after_its_load_is_loaded_again(world):
    loads = iter([frozenset(), frozenset({13})])  # the first load's stub dies before the supervisor looks
    world.on_load = lambda model: world.stubs.__setitem__(model, next(loads))
    sup = StubSupervisor(world)
    world.stubs[ENGINE] = frozenset()
    sup.step()
    sup.step()
    assert world.loads == [ENGINE, ENGINE] and sup.up[ENGINE] == {13}


@pytest.mark.timeout(30)
def test_a_load_left_without_a_stub_is_hung_and_gets_a_new_server(world, monkeypatch):
    """Triton 2.51 waits forever for the first message of a stub killed as it starts: the load never
    returns and the model stays LOADING. Only a new tritonserver gets out of it."""
    monkeypatch.setattr(StubSupervisor, "HUNG_AFTER_S", 0.1)
    hang = threading.Event()
    world.on_load = lambda model: (world.states.__setitem__(model, "LOADING"), hang.wait())

    def new_server():
        world.stubs[ENGINE] = frozenset({30})
        hang.set()  # the old server's load call ends with it
        return True
    world.on_restart = new_server
    sup = StubSupervisor(world)
    world.stubs[ENGINE] = frozenset()
    sup.step()
    assert len(world.triton_restarts) == 1 and "cannot finish" in world.triton_restarts[0]
    assert sup.up[ENGINE] == {30} and not sup.down and world.reloads == []


def test_a_slow_load_with_a_live_stub_is_waited_for(world, monkeypatch):
    monkeypatch.setattr(StubSupervisor, "HUNG_AFTER_S", 0.05)
    def slow(model):
        world.states[model] = "LOADING"
        world.stubs[model] = frozenset({14})
        time.sleep(0.3)
        world.states[model] = "READY"
    world.on_load = slow
    sup = StubSupervisor(world)
    world.stubs[ENGINE] = frozenset()
    sup.step()
    assert world.reloads == [ENGINE] and not world.triton_restarts


@pytest.mark.timeout(30)
def test_a_dead_server_is_replaced_and_its_stubs_watched(world):
    world.triton.code = -6  # a stub's death aborted tritonserver (boost lock_exception in the backend)

    def new_server():
        world.stubs = {ENGINE: frozenset({40}), "gateway": frozenset({41})}
        threading.Timer(0.1, world.stopping.set).start()
        return True
    world.on_restart = new_server
    sup = StubSupervisor(world)
    sup.run()
    assert world.triton_restarts == ["it exited with code -6"]
    assert sup.up == {ENGINE: {40}, "gateway": {41}} and world.loads == []


@pytest.mark.timeout(30)
def test_a_server_that_never_gets_ready_is_given_up_after_the_pauses(world, monkeypatch):
    monkeypatch.setattr(StubSupervisor, "RETRY_S", (0.0, 0.01))
    world.triton.code = -6
    world.on_restart = lambda: False
    sup = StubSupervisor(world)
    sup.run()  # returns: the launcher's wait() then stops the stack
    assert len(world.triton_restarts) == 3 and world.triton.code == -9


def test_a_server_that_stops_answering_is_replaced_once_and_a_slow_answer_is_not(world):
    """A tritonserver that aborted in its gRPC code was seen to hang instead of exiting: after
    UNRESPONSIVE_AFTER_S without a live answer it is replaced; a shorter silence is not."""
    clock = [0.0]
    sup = StubSupervisor(world, clock=lambda: clock[0])

    def tick(seconds):
        end = clock[0] + seconds
        while clock[0] < end:
            if sup._unresponsive():
                sup._restart("unresponsive")
            clock[0] += StubSupervisor.POLL_S

    world.live = False
    tick(StubSupervisor.UNRESPONSIVE_AFTER_S - 4)  # silent, but not long enough
    world.live = True
    tick(10)
    assert world.triton_restarts == []
    world.live = False
    tick(StubSupervisor.UNRESPONSIVE_AFTER_S + 3)
    assert world.triton_restarts == ["unresponsive"]
    world.live = True  # the new server answers: nothing more
    tick(60)
    assert world.triton_restarts == ["unresponsive"]
