"""Compare the CPU emulation (sage_qual.emulation) with the H200 kernels of device run 1 on the same
synthetic statistics (fresh CPU random draws, not the same tensors), one head per case."""
import itertools, json, torch
from sage_qual import emulation as em
from sage_qual.variants import VARIANTS
gpu = {}
for l in open('docs/runs/run1/probe.jsonl'):
    r = json.loads(l)
    if r['probe']=='outlier':
        gpu[(r['spread'],r['text'],r['where'],r['sigma'],r['variant'],r['smooth_k'])]=(r['rel_l2'],r['cos'])
g = torch.Generator().manual_seed(0)
N,D=4096,128
for spread,text,where,sigma in itertools.product((0.0,5.0),(0,512),("qk","k"),(1.0,3.0)):
    n=lambda *s: torch.randn(*s, generator=g)
    q,k,v = n(1,1,N,D)*sigma, n(1,1,N,D)*sigma, n(1,1,N,D)
    for t,on in ((q,"q" in where),(k,True)):
        if on: t[:,:,text:,7]=600+spread*n(1,1,N-text)
    q,k,v=(t.bfloat16() for t in (q,k,v))
    ref=em.reference(q,k,v)
    for vn in ("sm90-fp8-cuda","sm86-fp16-triton"):
        s=em.scheme_for(VARIANTS[vn])
        for sm in (True,False):
            e=em.errors(em.emulate(q,k,v,s,smooth_k=sm),ref)
            G=gpu[(spread,text,where,sigma,vn,sm)]
            print(f"{where:3} t{text:4} sp{spread} s{sigma} {vn[:5]} {'on ' if sm else 'off'} emu {e['rel_l2']:.3f}/{e['cosine']:.3f}  gpu {G[0]:.3f}/{G[1]:.3f}")
