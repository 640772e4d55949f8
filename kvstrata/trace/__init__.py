"""Request traces: kvstrata's format, the readers of every format ``kvstrata bench`` takes, the recorder.
May import: errors, system, identity, config.

:mod:`.format` (the header and the names every part agrees on), :mod:`.reader` (every
format, streamed) with :mod:`.line` (one line's fields per format) and :mod:`.requests`
(what a reader yields), the plugin's recorder (:mod:`.recorder`) and the reader of its
recordings (:mod:`.parts`)."""
