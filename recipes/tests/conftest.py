"""The recipes import each other by module name (``python recipes/gsm8k.py`` puts ``recipes/`` first on the path);
the tests do the same."""

from __future__ import annotations

import sys
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[1]
if str(RECIPES) not in sys.path:
    sys.path.insert(0, str(RECIPES))
