"""Controllers: how many proposals to verify and from which source, priced by measured cycle costs and past acceptance."""
