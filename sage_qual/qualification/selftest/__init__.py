"""The suite's checks of itself: injected kernel defects and the numerics model against a kernel."""
