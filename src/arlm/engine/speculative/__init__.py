"""Speculative decoding (see drafters.py)."""

from .drafters import (DECAY, DRIFT, MARGIN, PRIOR_WEIGHT, Drafter, ModelDrafter, NgramDrafter, SpecRates,
                       SpecState, SpeculativeConfig, StepCost, acceptance_probability, best_draft_length,
                       residual, self_draft, verify)
