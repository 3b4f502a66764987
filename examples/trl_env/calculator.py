"""The calculator task (examples/calculator) written as a TRL environment class: ``reset(**row)`` reads the row's
operands, the ``calculator`` method is the tool (the same function, the same description, so the model is shown
exactly what ``--tools examples/calculator/tools.py:calculator`` shows it), and ``examples/calculator/reward.py:correct``
scores the final reply as before. TRL's GRPOTrainer takes this class as ``environment_factory=CalculatorEnv``;
grpolab as ``--env examples/trl_env/calculator.py:CalculatorEnv``.
"""

import importlib.util
from pathlib import Path

# The example's own tool, loaded by path (examples/ is not a package).
_spec = importlib.util.spec_from_file_location(
    "calculator_tools", Path(__file__).parents[1] / "calculator" / "tools.py"
)
_tools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tools)


class CalculatorEnv:
    def reset(self, a, b, **kwargs) -> None:  # the row's columns as keywords; None: the row's prompt is the prompt
        self.product = a * b
        self.results = []

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return its value.

        Args:
            expression: numbers with + - * / and parentheses, e.g. 347*582
        """
        value = _tools.calculator(expression)
        self.results.append(value)
        return value
