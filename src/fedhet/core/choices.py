"""The values of a setting that both the config (which validates it) and the layer that acts on it
name: one list each, so that a new engine or store mode is added in one place."""

from __future__ import annotations

from typing import Literal

# run.engine: how the clients of a round are trained (fedhet.engine chooses for "auto")
EngineName = Literal["auto", "reference", "parallel", "vectorized"]

# run.client_state_store: where the clients' persistent states live (fedhet.engine.client_store)
StoreMode = Literal["auto", "memory", "disk"]
