"""Checks made when ``tokenward serve`` starts, beyond what the config schema can say alone.

The schema (:mod:`tokenward.proxy.config`) checks the file; this module checks the file against
the process's environment, which the report commands do not need (they read the same file
without the proxy's secrets). Each environment variable a config names gets one decision:

* ``alerts.smtp.username_env`` / ``password_env`` unset: **fail**. The operator asked for
  authenticated mail; without the secret every alert mail would be refused (or sent
  unauthenticated), and the first sign of it would be a budget alert that never arrives.
* a webhook's ``url_env`` unset: **fail** when a budget, ``alerts.admins`` or the digest sends
  to that webhook (alerts would be lost the same way); **warn** when nothing sends to it.
* an upstream's ``api_key_env`` unset: **warn** (logged by :class:`~tokenward.proxy.routing.Router`
  when the app is built) in ``virtual_keys`` mode, where tokenward sends that key. Other
  upstreams keep working and requests to this one are refused with an error naming the
  variable, so a config listing providers not yet in use still starts. In ``passthrough``
  mode the client's own key goes upstream and the variable is not used: nothing to say.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from tokenward.proxy.config import Config, ConfigError

__all__ = ["check_environment"]


def check_environment(config: Config, environ: Mapping[str, str] | None = None) -> list[str]:
    """Check the environment variables ``config`` names (see the module docstring for the rules).

    Args:
        config: a validated configuration.
        environ: the environment (default: ``os.environ``); an empty value counts as unset.

    Returns:
        Warnings to log (the proxy starts anyway).

    Raises:
        ConfigError: a variable whose absence would lose alerts is unset (one line, naming the
            option and the variable).
    """
    env = os.environ if environ is None else environ
    warnings: list[str] = []
    smtp = config.alerts.smtp
    if smtp is not None:
        for option, variable in (("username_env", smtp.username_env), ("password_env", smtp.password_env)):
            if variable and not env.get(variable):
                raise ConfigError(
                    f"alerts.smtp.{option}: environment variable {variable} is not set "
                    "(alert mail could not log in to the SMTP server)"
                )
    used = set(config.alerts.admins)
    for budget in config.budgets:
        used.update(budget.notify)
    if config.alerts.digest is not None:
        used.update(config.alerts.digest.to)
    for index, hook in enumerate(config.alerts.webhooks):
        if hook.url_env and not env.get(hook.url_env):
            where = f"alerts.webhooks[{index}].url_env"
            if hook.name in used:
                raise ConfigError(
                    f"{where}: environment variable {hook.url_env} is not set "
                    f"(alerts to webhook {hook.name!r} would be lost)"
                )
            warnings.append(f"{where}: environment variable {hook.url_env} is not set (nothing sends to {hook.name!r})")
    return warnings
