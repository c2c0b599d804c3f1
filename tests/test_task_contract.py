"""The written contracts hold: every task member the Trainer (train_lora.py) uses is in the Task
protocol (library/training/task.py) and both tasks have it with the protocol's parameters; both
network types have every member of the Network protocol (networks/factory.py). The Trainer is read
with ast, so a new `task.x` call without a protocol entry fails here."""

import ast
import inspect
import os

import pytest

from library.training.diffusion_task import DiffusionTask
from library.training.llm_task import LLMTask
from library.training.task import Task
from networks.factory import Network
from networks.lora import LoRANetwork

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


TRAINER_FILES = ("train_lora.py", "library/training/saves.py")  # the loop, and its saves


def trainer_task_uses() -> set[str]:
    """Names the trainer (TRAINER_FILES) reads from a task: `task.x` and `self.task.x`."""
    uses = set()
    for name in TRAINER_FILES:
        uses |= _task_uses(ast.parse(open(os.path.join(ROOT, name), encoding="utf-8").read()))
    return uses


def _task_uses(tree) -> set[str]:
    uses = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "task"
                    or isinstance(owner, ast.Attribute) and owner.attr == "task"):
                uses.add(node.attr)
    return uses


def members(protocol) -> dict[str, object]:
    """name -> the protocol's function (None for a data attribute)."""
    names = {n: None for n in getattr(protocol, "__annotations__", {})}
    names.update({n: f for n, f in vars(protocol).items() if callable(f) and not n.startswith("_")})
    names.update({n: f.__func__ for n, f in vars(protocol).items() if isinstance(f, classmethod)})
    return names


def assigns_attribute(cls, name: str) -> bool:
    """Whether the class's source sets self.<name> (instance attributes are not on the class)."""
    tree = ast.parse(inspect.getsource(cls).lstrip())
    return any(isinstance(n, ast.Attribute) and n.attr == name and isinstance(n.ctx, ast.Store) for n in ast.walk(tree))


def contract_breaches(protocol, cls) -> list[str]:
    """Members of `protocol` that `cls` lacks, or whose parameters differ: the protocol's come first,
    in order and by name; any further ones need a default."""
    breaches = []
    for name, spec in members(protocol).items():
        if spec is None:
            if not assigns_attribute(cls, name):
                breaches.append(f"{cls.__name__}.{name}: missing (attribute)")
            continue
        impl = inspect.getattr_static(cls, name, None)
        if impl is None:
            breaches.append(f"{cls.__name__}.{name}: missing")
            continue
        impl = impl.__func__ if isinstance(impl, (classmethod, staticmethod)) else impl
        wanted = [p for p in inspect.signature(spec).parameters if p not in ("self", "cls")]
        params = [p for p in inspect.signature(impl).parameters.values() if p.name not in ("self", "cls")]
        got = [p.name for p in params]
        extra = [p.name for p in params[len(wanted):] if p.default is inspect.Parameter.empty]
        if got[: len(wanted)] != wanted or extra:
            breaches.append(f"{cls.__name__}.{name}{tuple(got)}: the protocol has {tuple(wanted)}")
    return breaches


def test_the_trainer_uses_exactly_the_task_protocol():
    uses, declared = trainer_task_uses(), set(members(Task))
    assert uses - declared == set(), f"the trainer uses task members the Task protocol lacks: {sorted(uses - declared)}"
    assert declared - uses == set(), f"Task protocol members the trainer never uses: {sorted(declared - uses)}"


@pytest.mark.parametrize("task", [DiffusionTask, LLMTask])
def test_both_tasks_fulfil_the_task_protocol(task):
    assert contract_breaches(Task, task) == []


def test_both_network_types_fulfil_the_network_protocol():
    from networks.lycoris_network import LycorisNetwork  # needs the lycoris-lora package

    assert contract_breaches(Network, LoRANetwork) + contract_breaches(Network, LycorisNetwork) == []
