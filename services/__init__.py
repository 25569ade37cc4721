"""Actor services; each package is one actor. Services talk over the bus only."""
