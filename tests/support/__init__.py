"""What several test folders share: tiny models and packages, agent processes, fixtures."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
