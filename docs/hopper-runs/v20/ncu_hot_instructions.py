import csv,gzip,sys
rows=list(csv.reader(gzip.open(sys.argv[1],'rt')))
hdr=rows[1]; data=rows[2:]
ix={h:i for i,h in enumerate(hdr)}
stalls=[h for h in hdr if h.startswith('stall_') and 'Not Issued' not in h]
tot=sum(int(r[ix['Warp Stall Sampling (All Samples)']]) for r in data)
print('total samples',tot, 'instrs',len(data))
# print lines with samples>=0.2% of total, with top stalls
for n,r in enumerate(data):
    s=int(r[ix['Warp Stall Sampling (All Samples)']])
    ex=int(r[ix['Instructions Executed']] or 0)
    src=r[ix['Source']].strip()
    if s>=tot*0.002 or (any(k in src for k in ('FMNMX','MUFU','WARPGROUP','HGMMA','SHFL','VOTE','BAR','SYNCS','F2FP')) and ex>100000):
        top=sorted(((int(r[ix[h]]),h[6:]) for h in stalls),reverse=True)[:3]
        print(f"{n:5d} {s:6d} {ex:9d} {src[:60]:60s} "+' '.join(f"{h}:{v}" for v,h in top if v))
