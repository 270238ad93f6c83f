"""Continuous batching: requests, per-slot sampling, the SeqEngine mechanism and the Scheduler policy."""
from .request import Event, FinishEvent, Refused, Request, Sampling, TokenEvent
from .sampling import Choice, SlotSampler
from .scheduler import CohortFailed, QueueFull, Scheduler
from .seq_engine import Admission, Outcome, SeqEngine, StepError, Work

__all__ = ["Event", "FinishEvent", "Refused", "Request", "Sampling", "TokenEvent", "Choice", "SlotSampler",
           "CohortFailed", "QueueFull", "Scheduler", "Admission", "Outcome", "SeqEngine", "StepError", "Work"]
