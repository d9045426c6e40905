"""The engines behind arctic-rl's operations: plain classes, no Ray (heavy dependencies are imported lazily)."""
