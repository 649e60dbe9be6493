"""Data only: the IRs every planner, simulator and runtime reads (the Plan tree lives here)."""
