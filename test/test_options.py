"""ShardingOptions: one frozen object, one default per option, checked values, one way in."""

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
    options_or_defaults,
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


def test_options_are_a_sharding_options_or_none():
    assert options_or_defaults(None, "f") == ShardingOptions()
    given = ShardingOptions(atom_multiple=32)
    assert options_or_defaults(given, "f") is given
    with pytest.raises(TypeError, match="scatter_features: options must be ShardingOptions"):
        options_or_defaults({"method": "scatter_tensor"}, "scatter_features")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="plan_report: options must be ShardingOptions"):
        options_or_defaults("p2p", "plan_report")  # type: ignore[arg-type]


def _entry_points():
    """Every public function or class that takes ``options=``, called with its other arguments."""
    from physicsnemo_foldcp import FoldCPDataModule, ShardedLoader, scatter_features
    from physicsnemo_foldcp.sharding.plan_report import plan_report
    from physicsnemo_foldcp.sharding.prepare import prepare_sample
    from physicsnemo_foldcp.training.validate import validate_model

    return {
        "scatter_features": lambda **kw: scatter_features(None, None, **kw),
        "prepare_sample": lambda **kw: prepare_sample({}, None, (1, 1), **kw),
        "plan_report": lambda **kw: plan_report({}, (1, 1), **kw),
        "plan_token_bounds": lambda **kw: balance.plan_token_bounds({}, (1, 1), **kw),
        "ShardedLoader": lambda **kw: ShardedLoader([], None, **kw),
        "FoldCPDataModule": lambda **kw: FoldCPDataModule([], None, None, None, **kw),
        "validate_model": lambda **kw: validate_model(None, {}, None, **kw),
    }


OLD_KEYWORDS = {
    "token_multiple": 4,
    "atom_multiple": 32,
    "align_lengths": True,
    "map_layout": "index",
    "method": "scatter_tensor",
    "balance": "balanced",
    "pair_weight": 0.5,
    "atom_weight": 2.0,
    "scatter_options": {"map_layout": "index"},
}
"""The ways the options were given before ``options=`` was the only one."""


@pytest.mark.parametrize("entry", sorted(_entry_points()))
@pytest.mark.parametrize("keyword", sorted(OLD_KEYWORDS))
def test_an_old_keyword_is_refused_by_every_entry_point(entry, keyword):
    call = _entry_points()[entry]
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}'"):
        call(**{keyword: OLD_KEYWORDS[keyword]})


def test_the_cli_defaults_are_the_options_defaults():
    from physicsnemo_foldcp.cli.plan_report import build_parser, options_from_args

    args = build_parser().parse_args(["--tokens", "8", "--cp", "1", "1"])
    assert options_from_args(args) == ShardingOptions()
