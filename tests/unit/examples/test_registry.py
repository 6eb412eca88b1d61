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
