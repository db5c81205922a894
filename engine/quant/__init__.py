"""Weight (and activation) quantization schemes. The public face is `engine.quant.schemes`;
this package holds one module per family of schemes plus the shared tensor math."""
