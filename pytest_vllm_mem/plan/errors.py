"""Why a config has no plan: bad input, a config vLLM itself refuses before allocating, or one not modelled."""

from __future__ import annotations


class PlanError(ValueError):
    """A config the plan cannot compute: one paragraph naming the input and what is accepted."""


class PlanRefused(PlanError):
    """A config vLLM refuses before it allocates anything; the message is vLLM's reason, then what to change."""

    def __init__(self, reason: str, advice: str = "") -> None:
        self.reason = reason
        super().__init__(
            f"vLLM refuses this config before allocating memory: {reason}" + (f" {advice}" if advice else "")
        )


class PlanUnsupported(PlanError):
    """A config vLLM would run but whose memory the plan does not model (state layers, GGUF files ...)."""


__all__ = ["PlanError", "PlanRefused", "PlanUnsupported"]
