"""Other apps' SageAttention integrations under test, and the pytest plugin that runs them."""
