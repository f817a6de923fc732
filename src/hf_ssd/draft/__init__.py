"""The draft side: the drafter protocol the engine calls, the draft model wrapper, and the drafters."""
