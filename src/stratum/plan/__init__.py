"""Planning: how to cut a model over pipeline ranks (:mod:`.partition`), the auto plan search (:mod:`.search`,
:mod:`.predict`), burst plans (:mod:`.burst`) and prediction fidelity (:mod:`.fidelity`)."""
