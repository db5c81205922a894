"""Weight (and activation) quantization schemes. The public face is `engine.quantization`;
this package holds one module per family of schemes plus the shared tensor math."""
