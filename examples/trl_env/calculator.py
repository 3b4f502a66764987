"""The calculator task (examples/calculator) written as a TRL environment class: ``reset(**row)`` reads the row's
operands, the ``calculator`` method is the tool (the same function, the same description, so the model is shown
exactly what ``--tools examples/calculator/tools.py:calculator`` shows it), ``get_reward`` pays 0.2 for an episode
whose calls all returned a value (the example's ``--tool-reward 0.2``, from the environment's own state), and
``examples/calculator/reward.py:correct`` scores the final reply as before. TRL's GRPOTrainer takes this class as ``environment_factory=CalculatorEnv``;
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
        self.calls, self.results = 0, []

    def get_reward(self) -> float:
        """0.2 when the episode called the calculator and every call returned a value (a call that raises is
        answered with an error line by the trainer); the answer itself is scored by ``correct``."""
        return 0.2 if self.calls and len(self.results) == self.calls else 0.0

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return its value.

        Args:
            expression: numbers with + - * / and parentheses, e.g. 347*582
        """
        self.calls += 1
        value = _tools.calculator(expression)
        self.results.append(value)
        return value
