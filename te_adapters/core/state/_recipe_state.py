"""The typed recipe state of one GEMM: a registered pytree dataclass, with TE's names outside.

``DelayedScaling`` keeps, per GEMM role (``x``, ``kernel``, ``grad``), a float32 scale and an
amax history. ``DelayedScalingState`` holds them as fields; code asks it for a role's
``RoleState`` and for its scales by type, never by parsing names. The six fields carry TE's
variable names (``x_scale``, ``x_amax_history``, ``kernel_*``, ``grad_*``), which are also the
pytree keys and the read-only mapping view, so Linen collections, NNX variables, Haiku state and
checkpoints keep the names users see. A dict of those six names (the state layout before the
typed state, and what the adapters' variables hold) converts with ``from_mapping``.

Stateless recipes (current scaling and the block-scaled formats) keep no state: an
``EmptyState``, a pytree without leaves that reads as an empty mapping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax

__all__ = [
  "ROLES",
  "RoleState",
  "DelayedScalingState",
  "EmptyState",
  "is_state_mapping",
  "leaf_kind",
]

ROLES = ("x", "kernel", "grad")

# The field of each (role, kind) pair, in TE's spelling and order.
_FIELDS = tuple(
  (role, kind, f"{role}_{kind}") for role in ROLES for kind in ("scale", "amax_history")
)
NAMES: tuple[str, ...] = tuple(name for _, _, name in _FIELDS)
_SORTED = tuple(sorted(NAMES))
# How a leaf combines across uses under ``with_max_grad``: scales as scales, histories by max.
_KIND = {name: ("scale" if kind == "scale" else "max") for _, kind, name in _FIELDS}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoleState:
  """One role's delayed-scaling state: the stored ``scale`` and its ``amax_history``.

  A registered pytree dataclass; ``DelayedScalingState.role`` gives one, ``from_roles`` and
  ``with_roles`` take them.

  Args:
    scale: the role's stored scale, float32 ``(..., 1)``.
    amax_history: its amax history, float32 ``(..., L)``.

  Example:
    >>> import jax.numpy as jnp, te_adapters as ta
    >>> state = ta.core.init_state(ta.DelayedScaling(amax_history_len=4))
    >>> grad = ta.core.RoleState(scale=jnp.full((1,), 2.0), amax_history=jnp.zeros(4))
    >>> state.with_roles({"grad": grad})["grad_scale"].tolist(), state["grad_scale"].tolist()
    ([2.0], [1.0])
  """

  scale: Any
  amax_history: Any


@jax.tree_util.register_pytree_with_keys_class
@dataclasses.dataclass(frozen=True, eq=False)
class DelayedScalingState(Mapping):
  """The ``DelayedScaling`` state of one GEMM (or stacked copies of it: one per expert or layer).

  Fields are float32 arrays: scales of shape ``(..., 1)`` (1 initially: TE's value) and amax
  histories of shape ``(..., L)`` (zeros initially). It is a pytree whose keys are the field
  names and a read-only mapping of the same names, so ``state["x_scale"]`` and ``dict(state)``
  read it as TE names it. ``init_state(recipe)`` makes one; ``typed_state`` converts a mapping.

  Args:
    x_scale, kernel_scale, grad_scale: the three roles' stored scales.
    x_amax_history, kernel_amax_history, grad_amax_history: their amax histories.

  Example:
    >>> import te_adapters as ta
    >>> s = ta.core.init_state(ta.DelayedScaling(amax_history_len=4))
    >>> type(s).__name__, s.role("x").amax_history.shape, s["x_scale"].tolist()
    ('DelayedScalingState', (4,), [1.0])
  """

  x_scale: Any
  x_amax_history: Any
  kernel_scale: Any
  kernel_amax_history: Any
  grad_scale: Any
  grad_amax_history: Any

  # --- typed access ------------------------------------------------------------------------

  def role(self, role: str) -> RoleState:
    """The scale and amax history of ``role`` (``"x"``, ``"kernel"`` or ``"grad"``).

    Args:
      role: ``"x"``, ``"kernel"`` or ``"grad"``.

    Returns:
      The role's ``RoleState``.

    Raises:
      ValueError: another role.
    """
    _check_role(role)
    return RoleState(getattr(self, f"{role}_scale"), getattr(self, f"{role}_amax_history"))

  def with_roles(self, roles: Mapping[str, RoleState]) -> DelayedScalingState:
    """A copy with the given roles' states replaced.

    Args:
      roles: ``{role: RoleState}`` for some of the three roles.

    Returns:
      A new ``DelayedScalingState``; the other roles' entries are this one's.

    Raises:
      ValueError: an unknown role.
    """
    changes = {}
    for role, value in roles.items():
      _check_role(role)
      changes[f"{role}_scale"] = value.scale
      changes[f"{role}_amax_history"] = value.amax_history
    return dataclasses.replace(self, **changes)

  def scales(self) -> tuple[Any, ...]:
    """The scales of the three roles.

    Returns:
      ``(x_scale, kernel_scale, grad_scale)``.
    """
    return tuple(self.role(r).scale for r in ROLES)

  @classmethod
  def from_roles(cls, roles: Mapping[str, RoleState]) -> DelayedScalingState:
    """The state from all three roles' ``RoleState``.

    Args:
      roles: ``{role: RoleState}`` for ``"x"``, ``"kernel"`` and ``"grad"``.

    Returns:
      The ``DelayedScalingState``.

    Raises:
      ValueError: a role is missing.
    """
    missing = sorted(set(ROLES) - set(roles))
    if missing:
      raise ValueError(f"DelayedScalingState needs every role; missing {missing}")
    return cls(**{name: getattr(roles[r], k) for r, k, name in _FIELDS})

  @classmethod
  def from_mapping(cls, state: Mapping[str, Any]) -> DelayedScalingState:
    """The typed state from a mapping of TE's six names (a dict-layout state or checkpoint).

    Args:
      state: a mapping of exactly the six names, or a ``DelayedScalingState`` (returned as is).

    Returns:
      The ``DelayedScalingState``.

    Raises:
      TypeError: ``state`` is not a mapping.
      ValueError: names missing or unexpected (the message lists them).
    """
    if isinstance(state, cls):
      return state
    if not isinstance(state, Mapping):
      raise TypeError(f"state must be a DelayedScalingState or a dict, got {type(state).__name__}")
    missing = [n for n in NAMES if n not in state]
    extra = sorted(str(k) for k in state if k not in NAMES)
    if missing or extra:
      raise ValueError(
        f"a DelayedScaling state needs exactly the entries {list(NAMES)}: missing {missing}, "
        f"unexpected {extra}; start from te_adapters.core.init_state(recipe) (or "
        f"init_ragged_state) and copy the saved entries of those names into it"
      )
    return cls(**{n: state[n] for n in NAMES})

  # --- the mapping view with TE's names ----------------------------------------------------

  def __getitem__(self, name: str):
    if name not in _KIND:
      raise KeyError(name)
    return getattr(self, name)

  def __iter__(self) -> Iterator[str]:
    return iter(NAMES)

  def __len__(self) -> int:
    return len(NAMES)

  def __repr__(self) -> str:
    shapes = ", ".join(f"{n}={getattr(getattr(self, n), 'shape', '?')}" for n in NAMES)
    return f"DelayedScalingState({shapes})"

  # --- pytree ------------------------------------------------------------------------------

  # As a dict of the same names flattens: dict keys in sorted order, so paths read ['x_scale']
  # and the leaves come in the dict layout's order (checkpoints keep their names and order).

  def tree_flatten_with_keys(self):
    return [(jax.tree_util.DictKey(n), getattr(self, n)) for n in _SORTED], None

  def tree_flatten(self):
    return [getattr(self, n) for n in _SORTED], None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls(**dict(zip(_SORTED, children, strict=True)))


@jax.tree_util.register_pytree_with_keys_class
@dataclasses.dataclass(frozen=True, eq=False)
class EmptyState(Mapping):
  """The state of a recipe that keeps none (current scaling, the block-scaled formats).

  A pytree without leaves, so it passes through ``jit``, ``grad``, ``vmap`` and checkpointers
  unchanged, and an empty read-only mapping, so it equals ``{}`` (the spelling before the state
  was typed) and ``dict(state)`` is ``{}``.

  Example:
    >>> import te_adapters as ta
    >>> s = ta.core.init_state(ta.Float8CurrentScaling())
    >>> s, s == {}, len(s), jax.tree_util.tree_leaves(s)
    (EmptyState(), True, 0, [])
  """

  def __getitem__(self, name: str):
    raise KeyError(name)

  def __iter__(self) -> Iterator[str]:
    return iter(())

  def __len__(self) -> int:
    return 0

  def __repr__(self) -> str:
    return "EmptyState()"

  def tree_flatten_with_keys(self):
    return [], None

  def tree_flatten(self):
    return [], None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux, children
    return cls()


def _check_role(role) -> None:
  if role not in ROLES:
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def is_state_mapping(node: Any) -> bool:
  """Whether ``node`` is one GEMM's delayed-scaling state: typed, or a mapping of TE's six
  names (a Linen collection's or Haiku module's entries, an old dict-layout checkpoint).

  Args:
    node: any object (a node of a state tree).

  Returns:
    True for a ``DelayedScalingState`` or a mapping of exactly TE's six names.

  Example:
    >>> import te_adapters as ta
    >>> state = ta.core.init_state(ta.DelayedScaling(amax_history_len=4))
    >>> ta.core.is_state_mapping(state), ta.core.is_state_mapping(dict(state))
    (True, True)
    >>> ta.core.is_state_mapping({"layer": state})  # a tree holding one
    False
  """
  if isinstance(node, DelayedScalingState):
    return True
  return isinstance(node, Mapping) and len(node) == len(NAMES) and all(n in node for n in NAMES)


def leaf_kind(name) -> str | None:
  """``"scale"`` or ``"max"``: how the state entry named ``name`` combines across uses; None
  for a name that is no recipe-state entry."""
  return _KIND.get(name) if isinstance(name, str) else None
