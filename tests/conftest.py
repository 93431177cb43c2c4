"""Fixtures shared by several test modules."""

import pytest

from tests.support.agent_processes import Agents


@pytest.fixture
def agents(tmp_path):
    """Agent processes of one test (see :class:`tests.support.agent_processes.Agents`), all stopped at the end."""
    running = Agents(tmp_path)
    yield running
    running.stop_all()
