"""te_adapters.inspect holds the HLO and jaxpr inspection that te_adapters.core had; the core's
old spellings still work for one release, with a DeprecationWarning naming the new one."""

import pytest

import te_adapters as ta
from te_adapters import core, inspect

MOVED = (
  "Collective",
  "count_fp8_cublas_gemms",
  "count_fp8_dot_generals",
  "count_fp8_gemms",
  "dot_general_operand_dtypes",
  "hlo_collectives",
  "hlo_dot_operand_types",
)


@pytest.mark.parametrize("name", MOVED)
def test_the_old_spelling_warns_and_names_the_new_one(name):
  with pytest.warns(DeprecationWarning, match=rf"te_adapters\.inspect\.{name}\b"):
    assert getattr(core, name) is getattr(inspect, name)


def test_the_moved_names_are_public_in_inspect_and_gone_from_core_all():
  assert ta.inspect is inspect
  assert set(MOVED) <= set(inspect.__all__)
  assert not set(MOVED) & set(core.__all__)


def test_an_unknown_core_name_is_still_an_attribute_error():
  with pytest.raises(AttributeError, match="no_such_name"):
    core.no_such_name  # noqa: B018
