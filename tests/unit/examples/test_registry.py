"""trainpod.examples (the registry): what a job of each example may be, said before anything runs."""

import pytest

from trainpod.errors import ConfigError, UsageError
from trainpod.examples import EXAMPLES


@pytest.mark.parametrize("name,nodes,origin,error,says", [
    ("cifar10-dp", 2, "--nnodes", UsageError, "at most 1 node(s) (DataParallel stays in one process); across nodes use cifar10-ddp"),
    ("imagenet-elastic", 6, "--nodes", UsageError, "at most 4 node(s) (its elastic range is 2:4); more nodes wait as spares"),
    ("imagenet-elastic", 5, "PET_NNODES", ConfigError, "at most 4 node(s)"),
])
def test_more_nodes_than_an_example_trains_on_is_one_line_that_says_why(name, nodes, origin, error, says):
    with pytest.raises(error) as raised:
        EXAMPLES[name].check_nodes(nodes, origin)
    assert str(raised.value) == f"{origin}={nodes}: the example {name} trains on {says}" or (
        str(raised.value).startswith(f"{origin}={nodes}: the example {name} trains on {says}"))
    EXAMPLES[name].check_nodes(EXAMPLES[name].max_nodes, origin)  # as many as it takes: nothing to say


def test_each_examples_options_are_declared_once_where_the_launcher_reads_them():
    # The launcher checks an example's flags from the registry (no torch); its ranks parse them from its Recipe.
    import importlib

    from trainpod.examples import options, precision, resnet

    for name, example in EXAMPLES.items():
        recipe = importlib.import_module(example.module).RECIPE
        assert recipe.options == example.options, name
        assert [s.name for s in recipe.settings()] == [s.name for s in (*options.COMMON, *example.options)]
    assert tuple(resnet.ARCHS) == options.ARCHS and resnet.WIDTH == options.RESNET_WIDTH
    assert tuple(precision.DTYPES) == options.AMP_DTYPES


@pytest.mark.parametrize("args,env,error,says", [
    (["--max-steps", "-5"], {}, UsageError, "cifar10-ddp: --max-steps='-5': expected an integer >= 1"),
    ([], {"TRAINPOD_CHECKPOINT_EVERY": "0"}, ConfigError, "cifar10-ddp: TRAINPOD_CHECKPOINT_EVERY='0': expected an integer >= 1"),
    (["--bogus"], {}, UsageError, "cifar10-ddp: unrecognized arguments: --bogus"),
])
def test_an_examples_bad_flag_or_variable_is_one_line_in_the_launcher(args, env, error, says):
    with pytest.raises(error) as raised:
        EXAMPLES["cifar10-ddp"].check_args(args, env)
    assert str(raised.value) == says
    EXAMPLES["cifar10-ddp"].check_args(["--help"], {})  # the example's own to print, in its ranks
    EXAMPLES["imagenet-elastic"].check_args(["--arch", "resnet18", "--width", "8", "--image-size", "32"], {})
