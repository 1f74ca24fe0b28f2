"""ShardingOptions: one frozen object, one default per option, checked values, old aliases."""

import dataclasses
import math

import pytest

from physicsnemo_foldcp.sharding import balance, maps, scatter
from physicsnemo_foldcp.sharding.options import (
    BALANCE_MODES,
    MAP_LAYOUTS,
    METHODS,
    BalanceOptions,
    ShardingOptions,
    resolve_options,
)


def test_defaults_are_the_documented_ones():
    options = ShardingOptions()
    assert options.to_dict() == {
        "token_multiple": 1,
        "atom_multiple": 1,
        "align_lengths": False,
        "balance": {"mode": "even", "pair_weight": 0.0, "atom_weight": 1.0},
        "map_layout": "dense",
        "method": "p2p",
    }
    assert options.balance == BalanceOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.token_multiple = 4  # type: ignore[misc]


def test_from_mapping_reads_a_config_group_with_a_nested_balance():
    group = {
        "token_multiple": 4,
        "atom_multiple": 32,
        "map_layout": "index",
        "balance": {"mode": "balanced", "pair_weight": 0.5},
    }
    options = ShardingOptions.from_mapping(group)
    assert (options.token_multiple, options.atom_multiple, options.map_layout) == (4, 32, "index")
    assert options.balance == BalanceOptions(mode="balanced", pair_weight=0.5, atom_weight=1.0)
    assert ShardingOptions.from_mapping(None) == ShardingOptions()
    assert ShardingOptions.from_mapping(options.to_dict()) == options
    with pytest.raises(ValueError, match=r"unknown sharding option\(s\) \['atom_window'\]"):
        ShardingOptions.from_mapping({"atom_window": 32})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"token_multiple": 0}, r"token_multiple must be an integer >= 1, got 0"),
        ({"atom_multiple": True}, r"atom_multiple must be an integer >= 1, got True"),
        ({"atom_multiple": 2.0}, r"atom_multiple must be an integer >= 1, got 2.0"),
        ({"align_lengths": "yes"}, r"align_lengths must be a bool, got 'yes'"),
        ({"map_layout": "sparse"}, r"map_layout must be one of \('dense', 'index'\)"),
        ({"method": "broadcast"}, r"method must be one of \('p2p', 'scatter_tensor'\)"),
        ({"balance": {"mode": "greedy"}}, r"balance.mode must be one of \('even', 'balanced'\)"),
        ({"balance": {"pair_weight": -1.0}}, r"balance.pair_weight must be a finite number"),
        ({"balance": {"atom_weight": math.inf}}, r"balance.atom_weight must be a finite number"),
        ({"balance": {"atom_weight": 0}}, r"are both 0: there is nothing to balance"),
        ({"balance": "balanced"}, r"balance must be BalanceOptions"),
    ],
)
def test_invalid_values_name_the_option(values, message):
    with pytest.raises(ValueError, match=message):
        ShardingOptions.from_mapping(values)


def test_replace_checks_the_new_values():
    options = ShardingOptions(atom_multiple=32)
    assert options.replace(map_layout="index") == ShardingOptions(
        atom_multiple=32, map_layout="index"
    )
    with pytest.raises(ValueError, match="token_multiple must be an integer >= 1"):
        options.replace(token_multiple=-1)


def test_the_choices_are_declared_once():
    assert scatter.METHODS is METHODS
    assert maps.MAP_LAYOUTS is MAP_LAYOUTS
    assert balance.BALANCE_MODES is BALANCE_MODES


def test_old_keyword_arguments_are_aliases_of_the_fields():
    assert resolve_options(None) == ShardingOptions()
    got = resolve_options(
        None,
        {"token_multiple": 2, "map_layout": "index", "balance": "balanced", "pair_weight": 0.25},
    )
    assert got == ShardingOptions(
        token_multiple=2,
        map_layout="index",
        balance=BalanceOptions(mode="balanced", pair_weight=0.25),
    )
    whole = resolve_options(None, {"balance": {"mode": "balanced", "atom_weight": 2.0}})
    assert whole.balance == BalanceOptions(mode="balanced", atom_weight=2.0)
    assert resolve_options({"method": "scatter_tensor"}).method == "scatter_tensor"


def test_an_alias_may_repeat_but_not_contradict_the_options():
    options = ShardingOptions(atom_multiple=32, balance=BalanceOptions(mode="balanced"))
    assert resolve_options(options, {"atom_multiple": 32, "balance": "balanced"}) is not None
    with pytest.raises(
        ValueError,
        match=r"scatter_features: atom_multiple=8 contradicts options.atom_multiple=32",
    ):
        resolve_options(options, {"atom_multiple": 8})
    with pytest.raises(ValueError, match=r"balance='even' contradicts options.balance.mode"):
        resolve_options(options, {"balance": "even"}, caller="ShardedLoader")


def test_unknown_keywords_and_bad_aliases_are_errors():
    with pytest.raises(TypeError, match=r"got unexpected keyword argument\(s\) \['windows'\]"):
        resolve_options(None, {"windows": 32})
    with pytest.raises(ValueError, match="balance must be one of"):
        resolve_options(None, {"balance": "uniform"})
    with pytest.raises(ValueError, match="token_multiple must be an integer >= 1"):
        resolve_options(None, {"token_multiple": 0})
    with pytest.raises(TypeError, match="options must be ShardingOptions"):
        resolve_options("p2p")  # type: ignore[arg-type]


def test_the_cli_defaults_are_the_options_defaults():
    from physicsnemo_foldcp.cli.plan_report import build_parser, options_from_args

    args = build_parser().parse_args(["--tokens", "8", "--cp", "1", "1"])
    assert options_from_args(args) == ShardingOptions()
