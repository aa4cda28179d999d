"""The bottom layer: shared types (contract), body/head split helpers, errors, random streams."""
