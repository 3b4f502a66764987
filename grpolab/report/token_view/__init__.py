"""Where the credit lands, shown token by token: ``token_credit.jsonl`` as an HTML section and in a terminal.

``grpolab train --log-token-credit K`` records, for K rollouts per step, each completion token's text
span and the values the update saw or caused (``dlogp``, the change of the token's log-prob; the
advantage the loss gave it; the importance ratio; the sampler's entropy and log-prob). This module
reads those records and paints each token by one quantity: a self-contained HTML section for
``grpolab report`` (no script, hover a token for its values) and ``grpolab tokens`` in a terminal
(rich colours, or plain text with the numbers when stdout is not a terminal).

Written by hand because no library paints a run's per-token records; rich only draws the terminal's
colours, and the terminal text is wrapped here (rich's word wrap drops the whitespace at a break, and
a whitespace token's colour is part of the picture). Everything taken from the run is escaped with
``html.escape``. Pure rendering: no torch.
"""

from grpolab.report.token_view.page import (  # noqa: F401
    TOKEN_CSS,
    credit_figure,
    credit_section,
    legend_html,
    token_credit_html,
)
from grpolab.report.token_view.records import *  # noqa: F401,F403
from grpolab.report.token_view.terminal import plain_lines, render_terminal, wrap_cells  # noqa: F401
