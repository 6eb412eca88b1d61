"""The agent relies on torch's private API (see trainpod/agent.py): a torch upgrade that removes it fails here."""

import pytest

torch = pytest.importorskip("torch")

from trainpod import agent  # noqa: E402


def test_the_private_torch_api_the_agent_uses_is_there():
    missing = agent.torch_internals_missing()
    assert not missing, (
        f"torch {torch.__version__} lacks what trainpod.agent relies on: {'; '.join(missing)}. "
        f"It was checked with torch {', '.join(agent.CHECKED_WITH)}: adapt agent.py, then add this version to CHECKED_WITH"
    )


def test_the_installed_torch_is_one_the_agent_was_checked_with():
    assert torch.__version__.split("+")[0] in agent.CHECKED_WITH, (
        f"torch {torch.__version__} is not in trainpod.agent.CHECKED_WITH {agent.CHECKED_WITH}: read the agent's use of "
        "torch's private API against it, then add it"
    )
