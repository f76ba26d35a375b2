"""The works the chapters cite, in full, for the site's references page.

The chapters cite in the text by author and year ("Narayanan et al. 2021, sec.
3.3"); each entry here gives the whole citation (title, venue, arXiv id where
there is one) and the pattern that finds it in a chapter, so the page can say
which chapters cite it. tests/test_site_pages.py holds every author-year
citation in the chapters to an entry here, and every entry to a chapter.
"""

from __future__ import annotations

import re

# (how the chapters cite it: a regex over the text with its whitespace collapsed,
#  the full reference in markdown)
REFERENCES: tuple[tuple[str, str], ...] = (
    (r"Brandon et al\.,? 2023",
     "Brandon, W., et al. (2023). Striped Attention: Faster Ring Attention for "
     "Causal Transformers. arXiv:2311.09431."),
    (r"Brown et al\.,? 2020",
     "Brown, T. B., et al. (2020). Language Models are Few-Shot Learners. "
     "NeurIPS 2020. arXiv:2005.14165."),
    (r"Chen et al\.,? 2016",
     "Chen, T., Xu, B., Zhang, C., Guestrin, C. (2016). Training Deep Nets with "
     "Sublinear Memory Cost. arXiv:1604.06174."),
    (r"Chowdhery et al\.,? 2022",
     "Chowdhery, A., et al. (2022). PaLM: Scaling Language Modeling with "
     "Pathways. JMLR 24 (2023). arXiv:2204.02311."),
    (r"Dai et al\.,? 2024",
     "Dai, D., et al. (2024). DeepSeekMoE: Towards Ultimate Expert Specialization "
     "in Mixture-of-Experts Language Models. arXiv:2401.06066."),
    (r"Daly,? \(?2006",
     "Daly, J. T. (2006). A higher order estimate of the optimum checkpoint "
     "interval for restart dumps. Future Generation Computer Systems 22(3), "
     "303-312."),
    (r"Dao et al\.,? 2022",
     "Dao, T., Fu, D. Y., Ermon, S., Rudra, A., Ré, C. (2022). FlashAttention: "
     "Fast and Memory-Efficient Exact Attention with IO-Awareness. NeurIPS 2022. "
     "arXiv:2205.14135."),
    (r"DeepSeek-AI,? 2024",
     "DeepSeek-AI (2024). DeepSeek-V3 Technical Report. arXiv:2412.19437."),
    (r"Douillard et al\.,? 2023",
     "Douillard, A., et al. (2023). DiLoCo: Distributed Low-Communication "
     "Training of Language Models. arXiv:2311.08105."),
    (r"Douillard et al\.,? 2025",
     "Douillard, A., et al. (2025). Streaming DiLoCo with overlapping "
     "communication: Towards a Distributed Free Lunch. arXiv:2501.18512."),
    (r"Fang (?:&|and) Zhao,? 2024",
     "Fang, J., Zhao, S. (2024). USP: A Unified Sequence Parallelism Approach for "
     "Long Context Generative AI. arXiv:2405.07719."),
    (r"Fedus et al\.,? 2021",
     "Fedus, W., Zoph, B., Shazeer, N. (2021). Switch Transformers: Scaling to "
     "Trillion Parameter Models with Simple and Efficient Sparsity. JMLR 23 "
     "(2022). arXiv:2101.03961."),
    (r"Gale et al\.,? 2022",
     "Gale, T., Narayanan, D., Young, C., Zaharia, M. (2022). MegaBlocks: "
     "Efficient Sparse Training with Mixture-of-Experts. MLSys 2023. "
     "arXiv:2211.15841."),
    (r"Huang et al\.,? 2019",
     "Huang, Y., et al. (2019). GPipe: Efficient Training of Giant Neural Networks "
     "using Pipeline Parallelism. NeurIPS 2019. arXiv:1811.06965."),
    (r"Jacobs et al\.,? 2023",
     "Jacobs, S. A., et al. (2023). DeepSpeed Ulysses: System Optimizations for "
     "Enabling Training of Extreme Long Sequence Transformer Models. "
     "arXiv:2309.14509."),
    (r"Jiang et al\.,? 2024",
     "Jiang, A. Q., et al. (2024). Mixtral of Experts. arXiv:2401.04088."),
    (r"Jordan et al\.,? 2024",
     "Jordan, K., et al. (2024). Muon: An optimizer for hidden layers in neural "
     "networks. Blog post, kellerjordan.github.io/posts/muon."),
    (r"Jouppi et al\.,? \*?TPU v4\*?,? ISCA 2023",
     "Jouppi, N. P., et al. (2023). TPU v4: An Optically Reconfigurable "
     "Supercomputer for Machine Learning with Hardware Support for Embeddings. "
     "ISCA 2023. arXiv:2304.01433."),
    (r"Kaplan et al\.,? 2020",
     "Kaplan, J., et al. (2020). Scaling Laws for Neural Language Models. "
     "arXiv:2001.08361."),
    (r"Korthikanti et al\.,? 2022",
     "Korthikanti, V., et al. (2022). Reducing Activation Recomputation in Large "
     "Transformer Models. MLSys 2023. arXiv:2205.05198."),
    (r"Lepikhin et al\.,? 2020",
     "Lepikhin, D., et al. (2020). GShard: Scaling Giant Models with Conditional "
     "Computation and Automatic Sharding. ICLR 2021. arXiv:2006.16668."),
    (r"Li et al\.,? 2014",
     "Li, M., et al. (2014). Scaling Distributed Machine Learning with the "
     "Parameter Server. OSDI 2014."),
    (r"Li et al\.,? 2020",
     "Li, S., et al. (2020). PyTorch Distributed: Experiences on Accelerating Data "
     "Parallel Training. VLDB 2020. arXiv:2006.15704."),
    (r"Liu et al\.,? 2023",
     "Liu, H., Zaharia, M., Abbeel, P. (2023). Ring Attention with Blockwise "
     "Transformers for Near-Infinite Context. ICLR 2024. arXiv:2310.01889."),
    (r"Liu et al\.,? 2025",
     "Liu, D., et al. (2025). MoE Parallel Folding: Heterogeneous Parallelism "
     "Mappings for Efficient Large-Scale MoE Model Training with Megatron Core. "
     "arXiv:2504.14960."),
    (r"Llama Team,? 2024",
     "Llama Team, AI @ Meta (2024). The Llama 3 Herd of Models. "
     "arXiv:2407.21783."),
    (r"Mehta,? 2026",
     "Mehta (2026). Placement Semantics for Distributed Deep Learning. "
     "arXiv:2601.02311."),
    (r"Milakov (?:&|and) Gimelshein,? 2018",
     "Milakov, M., Gimelshein, N. (2018). Online normalizer calculation for "
     "softmax. arXiv:1805.02867."),
    (r"Narayanan et al\.,? 2021",
     "Narayanan, D., et al. (2021). Efficient Large-Scale Language Model Training "
     "on GPU Clusters Using Megatron-LM. SC21. arXiv:2104.04473."),
    (r"Patarasuk (?:&|and) Yuan,? 2009",
     "Patarasuk, P., Yuan, X. (2009). Bandwidth optimal all-reduce algorithms for "
     "clusters of workstations. Journal of Parallel and Distributed Computing "
     "69(2), 117-124."),
    (r"Qi et al\.,? 2024",
     "Qi, P., Wan, X., Huang, G., Lin, M. (2024). Zero Bubble Pipeline "
     "Parallelism. ICLR 2024. arXiv:2401.10241."),
    (r"Rajbhandari et al\.,? 2020",
     "Rajbhandari, S., Rasley, J., Ruwase, O., He, Y. (2020). ZeRO: Memory "
     "Optimizations Toward Training Trillion Parameter Models. SC20. "
     "arXiv:1910.02054."),
    (r"Rajbhandari et al\.,? 2021",
     "Rajbhandari, S., et al. (2021). ZeRO-Infinity: Breaking the GPU Memory Wall "
     "for Extreme Scale Deep Learning. SC21. arXiv:2104.07857."),
    (r"Rajbhandari et al\.,? 2022",
     "Rajbhandari, S., et al. (2022). DeepSpeed-MoE: Advancing Mixture-of-Experts "
     "Inference and Training to Power Next-Generation AI Scale. ICML 2022. "
     "arXiv:2201.05596."),
    (r"Ren et al\.,? 2021",
     "Ren, J., et al. (2021). ZeRO-Offload: Democratizing Billion-Scale Model "
     "Training. USENIX ATC 2021. arXiv:2101.06840."),
    (r"Shazeer (?:&|and) Stern,? 2018",
     "Shazeer, N., Stern, M. (2018). Adafactor: Adaptive Learning Rates with "
     "Sublinear Memory Cost. ICML 2018. arXiv:1804.04235."),
    (r"Shoeybi et al\.,? 2019",
     "Shoeybi, M., et al. (2019). Megatron-LM: Training Multi-Billion Parameter "
     "Language Models Using Model Parallelism. arXiv:1909.08053."),
    (r"Wang et al\.,? 2024",
     "Wang, L., et al. (2024). Auxiliary-Loss-Free Load Balancing Strategy for "
     "Mixture-of-Experts. arXiv:2408.15664."),
    (r"Williams, Waterman (?:&|and) Patterson,? 2009",
     "Williams, S., Waterman, A., Patterson, D. (2009). Roofline: an insightful "
     "visual performance model for multicore architectures. Communications of "
     "the ACM 52(4), 65-76."),
    (r"You et al\.,? 2020",
     "You, Y., et al. (2020). Large Batch Optimization for Deep Learning: Training "
     "BERT in 76 minutes. ICLR 2020. arXiv:1904.00962."),
    (r"Young,? \(?1974",
     "Young, J. W. (1974). A first order approximation to the optimum "
     "checkpoint interval. Communications of the ACM 17(9), 530-531."),
)

# an author-year citation in a chapter's text: "Name et al. 2021", "A & B, 2009",
# "DeepSeek-AI 2024", "Llama Team 2024"
CITATION = re.compile(r"\b(?:[A-Z][\w-]+ et al\.|[A-Z][\w-]+ (?:&|and) [A-Z][\w-]+|"
                      r"DeepSeek-AI|Llama Team|Mehta),? (?:19|20)\d\d\b")


def flat(text: str) -> str:
    """`text` with its whitespace collapsed (citations break across lines)."""
    return " ".join(text.split())


def cited_in(texts: dict[str, str]) -> list[tuple[str, list[str]]]:
    """(reference, the names of the texts citing it) for every entry."""
    return [(ref, [name for name, text in texts.items()
                   if re.search(pattern, flat(text))])
            for pattern, ref in REFERENCES]


def unknown_citations(texts: dict[str, str]) -> list[str]:
    """Author-year citations in `texts` that no entry's pattern covers."""
    out = []
    for name, text in texts.items():
        text = flat(text)
        for m in CITATION.finditer(text):
            window = text[max(0, m.start() - 30):m.end()]
            if not any(re.search(p, window) for p, _ in REFERENCES):
                out.append(f"{name}: {m.group(0)}")
    return out
