"""Rank layout: one Layout validated once; coordinates, engine groups, weight-update ranks, model checks."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen3Config, Qwen3MoeConfig

from rollfleet.layout import Layout, LayoutError, engine_rank_groups, weight_update_group

settings.register_profile("layout", deadline=None, max_examples=150)
settings.load_profile("layout")


@st.composite
def grids(draw):
    """(dp, pp, tp, ep) with ep dividing tp."""
    tp = draw(st.integers(1, 8))
    ep = draw(st.sampled_from([d for d in range(1, tp + 1) if tp % d == 0]))
    return draw(st.integers(1, 4)), draw(st.integers(1, 4)), tp, ep


def tiny_dense():
    return Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )


def tiny_moe():
    return Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )


def build_rank_infos(dp, pp, tp, ep=1):
    return Layout(dp, tp, pp, ep).ranks()


def validate_layout(world, tp_size, pp_size, ep_size, model_config=None, *, allow_kv_head_replication=False):
    """A layout of `world` GPUs, checked against a model when one is given."""
    layout = Layout(world // (tp_size * pp_size), tp_size, pp_size, ep_size)
    if model_config is not None:
        layout.check_model(model_config, allow_kv_head_replication=allow_kv_head_replication)


# --- ranks ------------------------------------------------------------------------------


def test_concrete_layout_tp_fastest_then_pp_then_dp():
    infos = Layout(num_engines=2, tp_size=2, pp_size=2, ep_size=1).ranks()
    coords = [(i.dp_rank, i.pp_rank, i.tp_rank) for i in infos]
    assert coords == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]
    assert [i.rank for i in infos if i.is_engine_head] == [0, 4]
    assert [i.rank_in_engine for i in infos] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert {i.world_size for i in infos} == {8}


def test_ep_rank_follows_sglang_strided_expert_groups():
    # tp=4, ep=2: SGLang's expert groups are tp ranks {0, 2} and {1, 3}; rank 2 holds the second half.
    assert [i.ep_rank for i in build_rank_infos(1, 1, 4, 2)] == [0, 0, 1, 1]
    assert [i.ep_rank for i in build_rank_infos(1, 1, 4, 4)] == [0, 1, 2, 3]
    assert [i.ep_rank for i in build_rank_infos(1, 1, 4, 1)] == [0, 0, 0, 0]


@given(grids())
def test_ep_rank_is_index_in_sglang_expert_group(grid):
    dp, pp, tp, ep = grid
    infos = build_rank_infos(dp, pp, tp, ep)
    # SGLang (parallel_state.initialize_model_parallel) builds expert groups inside each
    # tp group as range(start + j, end + j, tp // ep) for j in range(tp // ep).
    stride = tp // ep
    for group_start in range(0, len(infos), tp):
        for j in range(stride):
            group = list(range(group_start + j, group_start + tp, stride))
            assert [infos[r].ep_rank for r in group] == list(range(ep))


@given(grids())
def test_ranks_unique_and_cover_world(grid):
    dp, pp, tp, ep = grid
    infos = build_rank_infos(dp, pp, tp, ep)
    assert [i.rank for i in infos] == list(range(dp * pp * tp))
    coords = {(i.dp_rank, i.pp_rank, i.tp_rank) for i in infos}
    assert len(coords) == len(infos)
    assert all(0 <= i.tp_rank < tp and 0 <= i.pp_rank < pp and 0 <= i.dp_rank < dp for i in infos)
    assert all(0 <= i.ep_rank < ep for i in infos)
    assert all((i.dp_size, i.pp_size, i.tp_size, i.ep_size) == (dp, pp, tp, ep) for i in infos)


@given(grids())
def test_each_engine_has_its_ranks_contiguous_with_one_head(grid):
    dp, pp, tp, ep = grid
    groups = engine_rank_groups(build_rank_infos(dp, pp, tp, ep))
    assert sorted(groups) == list(range(dp))
    for engine_id, ranks in groups.items():
        assert len(ranks) == tp * pp
        assert [r.rank for r in ranks] == list(range(engine_id * tp * pp, (engine_id + 1) * tp * pp))
        assert [r.rank_in_engine for r in ranks] == list(range(tp * pp))
        heads = [r for r in ranks if r.is_engine_head]
        assert len(heads) == 1 and heads[0] is ranks[0]


@given(grids())
def test_coordinates_round_trip_to_rank(grid):
    dp, pp, tp, ep = grid
    for info in build_rank_infos(dp, pp, tp, ep):
        assert info.dp_rank * tp * pp + info.pp_rank * tp + info.tp_rank == info.rank
        assert info.engine_id * tp * pp + info.rank_in_engine == info.rank


@given(grids())
def test_weight_update_group_ranks_are_one_plus_rollout_rank(grid):
    dp, pp, tp, ep = grid
    infos = build_rank_infos(dp, pp, tp, ep)
    offsets, world_size = weight_update_group([tp * pp] * dp)
    group_ranks = [offsets[i.engine_id] + i.rank_in_engine for i in infos]
    assert group_ranks == [i.rank + 1 for i in infos]
    # Trainer rank 0 plus every engine rank fills the group exactly.
    assert sorted([0, *group_ranks]) == list(range(world_size))


def test_weight_update_numbers():
    assert weight_update_group([4, 4, 4]) == ([1, 5, 9], 13)
    assert weight_update_group([2, 4]) == ([1, 3], 7)  # a subset of engines numbers only them
    assert weight_update_group([]) == ([], 1)


def test_engine_rank_groups_orders_shuffled_input():
    infos = build_rank_infos(2, 2, 2, 1)
    shuffled = infos[:]
    random.Random(0).shuffle(shuffled)
    assert engine_rank_groups(shuffled) == {0: infos[:4], 1: infos[4:]}


@pytest.mark.parametrize(
    "sizes, named",
    [
        ((0, 1, 1, 1), "num_engines=0"),
        ((1, 0, 1, 1), "tp_size=0"),
        ((1, 4, 1, 3), "ep_size=3: must divide tp_size=4"),
        ((1, 1, 0, 1), "pp_size=0"),
        ((1, 2, 1, 0), "ep_size=0"),
    ],
)
def test_layout_rejects_bad_sizes_naming_field_value_and_fix(sizes, named):
    with pytest.raises(LayoutError, match=named) as err:
        Layout(*sizes)
    assert "fix:" in str(err.value) and err.value.problems[0].value in sizes


@given(st.integers(0, 4), st.integers(0, 6), st.integers(0, 4), st.integers(0, 6))
def test_layout_accepts_iff_sizes_are_positive_and_ep_divides_tp(engines, tp, pp, ep):
    valid = min(engines, tp, pp, ep) >= 1 and tp % ep == 0
    if valid:
        layout = Layout(engines, tp, pp, ep)
        assert layout.world_size == engines * tp * pp and layout.gpus_per_engine == tp * pp
    else:
        with pytest.raises(LayoutError, match="invalid rollout layout"):
            Layout(engines, tp, pp, ep)


# --- model checks ---------------------------------------------------------------------------


@given(
    tp=st.integers(1, 8),
    pp=st.integers(1, 4),
    ep=st.integers(1, 8),
    heads=st.integers(1, 16),
    kv_heads=st.integers(1, 16),
    experts=st.integers(0, 16),
    layers=st.integers(1, 6),
)
def test_validate_layout_with_model_accepts_iff_model_splits(tp, pp, ep, heads, kv_heads, experts, layers):
    model = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "num_hidden_layers": layers}
    if experts:
        model["num_experts"] = experts
    splits = (
        tp % ep == 0
        and heads % tp == 0
        and kv_heads % tp == 0
        and (experts % ep == 0 if experts else ep == 1)
        and layers >= pp
    )
    if splits:
        validate_layout(tp * pp, tp, pp, ep, model_config=model)
    else:
        with pytest.raises(ValueError):
            validate_layout(tp * pp, tp, pp, ep, model_config=model)


def test_qwen3_heads_split_by_tp():
    validate_layout(4, tp_size=2, pp_size=1, ep_size=1, model_config=tiny_dense())
    with pytest.raises(ValueError) as err:
        validate_layout(4, tp_size=4, pp_size=1, ep_size=1, model_config=tiny_dense())
    message = str(err.value)
    assert "num_key_value_heads=2" in message and "tp_size=4" in message and "fix:" in message
    assert "num_attention_heads" not in message  # 4 heads split fine over tp=4


def test_kv_head_replication_is_opt_in():
    validate_layout(4, 4, 1, 1, model_config=tiny_dense(), allow_kv_head_replication=True)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        validate_layout(3, 3, 1, 1, model_config=tiny_dense(), allow_kv_head_replication=True)


def test_qwen3_moe_experts_split_by_ep():
    validate_layout(2, tp_size=2, pp_size=1, ep_size=2, model_config=tiny_moe())
    moe = tiny_moe().to_dict() | {"num_experts": 6, "num_attention_heads": 8, "num_key_value_heads": 4}
    with pytest.raises(ValueError, match=r"ep_size=4: the model's number of experts=6"):
        validate_layout(4, tp_size=4, pp_size=1, ep_size=4, model_config=moe)


@pytest.mark.parametrize("name", ["num_local_experts", "n_routed_experts"])
def test_other_expert_count_names(name):
    model = {"num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, name: 6}
    with pytest.raises(ValueError, match="experts=6"):
        validate_layout(4, 4, 1, 4, model_config=model)


def test_expert_parallel_on_dense_model_rejected():
    with pytest.raises(ValueError, match="ep_size=2: the model has no experts"):
        validate_layout(2, 2, 1, 2, model_config=tiny_dense())


def test_more_pipeline_stages_than_layers_rejected():
    validate_layout(2, 1, 2, 1, model_config=tiny_moe())
    with pytest.raises(ValueError, match="pp_size=3.*num_hidden_layers=2"):
        validate_layout(3, 1, 3, 1, model_config=tiny_moe())


def test_nested_text_config_is_used():
    model = {"text_config": {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}}
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        validate_layout(4, 4, 1, 1, model_config=model)
