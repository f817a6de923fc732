"""Pure tensor math and small types: no models, no threads. Everything here is exhaustively testable."""
