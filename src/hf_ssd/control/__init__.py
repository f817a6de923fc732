"""Choosing how to decode: measured costs, predicted plans, the online controller and the drafter that obeys it."""
